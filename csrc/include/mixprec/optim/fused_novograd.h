// mixprec::optim::FusedNovoGrad: NovoGrad (layer-wise second moments) in one fused
// mixprec::novograd_ pass per param group; the C++ twin of python/mixprec/optimizers/fused_novograd.py.
#pragma once

#include <map>
#include <utility>
#include <vector>

#include <mixprec/optim/fused_optimizer.h>

namespace mixprec::optim {

// Apex's FusedNovoGrad defaults. norm_type 2, or 0 / infinity for the infinity norm.
struct FusedNovoGradOptions : public FusedOptions {
  FusedNovoGradOptions(double lr = 1e-3);  // NOLINT
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, grad_averaging) = true;
  TORCH_ARG(bool, reg_inside_moment) = false;
  TORCH_ARG(double, norm_type) = 2.0;
  TORCH_ARG(bool, init_zero) = false;
  TORCH_ARG(bool, master_weights) = false;

 public:
  std::unique_ptr<torch::optim::OptimizerOptions> clone() const override;
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr_; }
  void set_lr(const double lr) override { lr_ = lr; }
  bool uses_master_weights() const override { return master_weights_; }
  void set_master_weights(bool on) override { master_weights_ = on; }
  void check(const std::string& where) const override;
  void inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh) override;
  double op_norm_type() const;  // 2 or inf, as the op takes it
};

struct FusedNovoGradParamState : public FusedCloneableParamState<FusedNovoGradParamState> {
  TORCH_ARG(at::Tensor, exp_avg);  // float32 first moment

 public:
  std::vector<Slot> slots() override;
};

// Each group's per-tensor second moments live in one float32 vector, the group tensor
// "exp_avg_sq" (one entry per param of the group), as in the Python front.
class FusedNovoGrad : public FusedOptimizer {
  MIXPREC_FUSED_OPTIMIZER_CLONE(FusedNovoGrad, FusedNovoGradOptions)

 public:
  explicit FusedNovoGrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                         FusedNovoGradOptions defaults = {});
  explicit FusedNovoGrad(std::vector<at::Tensor> params, FusedNovoGradOptions defaults = {});

  // The second moments of group `group` (undefined before its first step).
  at::Tensor exp_avg_sq(size_t group) { return group_tensor(group, "exp_avg_sq"); }

 protected:
  std::unique_ptr<FusedParamState> make_state() const override;
  std::unique_ptr<FusedOptions> make_options() const override;
  const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const override;
  void init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) override;
  void step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                  const StepArgs& args) override;
  at::Tensor checked_group_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                  const torch::optim::OptimizerParamGroup& group) const override;

 private:
  // Device index tensors of the positions with grads, for groups where only some params have one.
  std::map<std::pair<std::vector<int64_t>, std::string>, at::Tensor> index_cache_;
};

}  // namespace mixprec::optim
