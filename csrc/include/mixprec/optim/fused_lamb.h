// mixprec::optim::FusedLAMB: LAMB with global-norm clipping and NVLAMB in fused mixprec::lamb_
// passes; the C++ twin of python/mixprec/optimizers/fused_lamb.py (same defaults, same ops).
#pragma once

#include <c10/core/Device.h>

#include <tuple>
#include <utility>
#include <vector>

#include <mixprec/optim/fused_optimizer.h>

namespace mixprec::optim {

// Apex's FusedLAMB defaults. max_grad_norm 0 (or inf) turns clipping off.
struct FusedLAMBOptions : public FusedOptions {
  FusedLAMBOptions(double lr = 1e-3);  // NOLINT
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, grad_averaging) = true;
  TORCH_ARG(bool, adam_w_mode) = true;
  TORCH_ARG(double, max_grad_norm) = 1.0;
  TORCH_ARG(bool, use_nvlamb) = false;
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
  bool clips() const;
};

struct FusedLAMBParamState : public FusedCloneableParamState<FusedLAMBParamState> {
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);

 public:
  std::vector<Slot> slots() override;
};

// Each step first takes the unscaled L2 norm of every gradient of every group together (on the
// device), then per group the Adam moments and the trust-ratio update (see fused_lamb.py).
class FusedLAMB : public FusedOptimizer {
  MIXPREC_FUSED_OPTIMIZER_CLONE(FusedLAMB, FusedLAMBOptions)

 public:
  explicit FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedLAMBOptions defaults = {});
  explicit FusedLAMB(std::vector<at::Tensor> params, FusedLAMBOptions defaults = {});

 protected:
  std::unique_ptr<FusedParamState> make_state() const override;
  std::unique_ptr<FusedOptions> make_options() const override;
  const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const override;
  void init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) override;
  void step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                  const StepArgs& args) override;
  void begin_step() override;
  void end_step() noexcept override;

 private:
  // The global gradient norm of this step, one copy per device in use.
  std::vector<std::pair<c10::Device, at::Tensor>> grad_norms_;
};

}  // namespace mixprec::optim
