// mixprec::optim::FusedSGD: SGD with momentum, dampening, Nesterov and weight decay in one fused
// mixprec::sgd_ pass per param group; the C++ twin of python/mixprec/optimizers/fused_sgd.py.
#pragma once

#include <mixprec/optim/fused_optimizer.h>

namespace mixprec::optim {

// torch::optim::SGDOptions' fields plus Apex's wd_after_momentum; lr has no default, as in torch.
struct FusedSGDOptions : public FusedOptions {
  FusedSGDOptions(double lr);  // NOLINT: implicit like torch::optim::SGDOptions
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, nesterov) = false;
  // Apex: decay added to the momentum-filtered direction instead of to the gradient.
  TORCH_ARG(bool, wd_after_momentum) = false;
  TORCH_ARG(bool, maximize) = false;
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
};

struct FusedSGDParamState : public FusedCloneableParamState<FusedSGDParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);  // float32; made at the param's first step with momentum

 public:
  std::vector<Slot> slots() override;
};

// torch::optim::SGD's numerics (a new momentum buffer starts as the gradient itself).
class FusedSGD : public FusedOptimizer {
  MIXPREC_FUSED_OPTIMIZER_CLONE(FusedSGD, FusedSGDOptions)

 public:
  explicit FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedSGDOptions defaults);
  explicit FusedSGD(std::vector<at::Tensor> params, FusedSGDOptions defaults);

 protected:
  std::unique_ptr<FusedParamState> make_state() const override;
  std::unique_ptr<FusedOptions> make_options() const override;
  const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const override;
  void init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) override;
  void step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                  const StepArgs& args) override;
};

}  // namespace mixprec::optim
