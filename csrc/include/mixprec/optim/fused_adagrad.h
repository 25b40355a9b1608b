// mixprec::optim::FusedAdagrad: Adagrad (L2 or decoupled decay) in one fused mixprec::adagrad_ pass
// per param group; the C++ twin of python/mixprec/optimizers/fused_adagrad.py.
#pragma once

#include <mixprec/optim/fused_optimizer.h>

namespace mixprec::optim {

// Apex's FusedAdagrad defaults plus torch::optim::AdagradOptions' lr_decay and
// initial_accumulator_value, and maximize.
struct FusedAdagradOptions : public FusedOptions {
  FusedAdagradOptions(double lr = 1e-2);  // NOLINT
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, eps) = 1e-10;
  TORCH_ARG(double, weight_decay) = 0.0;
  // Apex: decoupled decay, w -= lr * (g / (sqrt(sum) + eps) + weight_decay * w).
  TORCH_ARG(bool, adagrad_w_mode) = false;
  TORCH_ARG(double, lr_decay) = 0.0;
  TORCH_ARG(double, initial_accumulator_value) = 0.0;
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

struct FusedAdagradParamState : public FusedCloneableParamState<FusedAdagradParamState> {
  TORCH_ARG(at::Tensor, sum);  // float32 sums of squared gradients

 public:
  std::vector<Slot> slots() override;
};

class FusedAdagrad : public FusedOptimizer {
  MIXPREC_FUSED_OPTIMIZER_CLONE(FusedAdagrad, FusedAdagradOptions)

 public:
  explicit FusedAdagrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                        FusedAdagradOptions defaults = {});
  explicit FusedAdagrad(std::vector<at::Tensor> params, FusedAdagradOptions defaults = {});

 protected:
  std::unique_ptr<FusedParamState> make_state() const override;
  std::unique_ptr<FusedOptions> make_options() const override;
  const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const override;
  void init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) override;
  void step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                  const StepArgs& args) override;
};

}  // namespace mixprec::optim
