// mixprec::optim::FusedAdam and FusedAdamW: Adam/AdamW in one fused mixprec::adam_ pass per param
// group; the C++ twin of python/mixprec/optimizers/fused_adam.py (same defaults, same op).
#pragma once

#include <c10/core/ScalarType.h>

#include <tuple>

#include <mixprec/optim/fused_optimizer.h>

namespace mixprec::optim {

// Apex's and the Python front's defaults: adam_w_mode=true (decoupled decay), weight_decay 0.
struct FusedAdamOptions : public FusedOptions {
  FusedAdamOptions(double lr = 1e-3);  // NOLINT: implicit like torch::optim::AdamOptions
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, amsgrad) = false;
  // true: AdamW's decoupled decay; false: L2 added to the gradient (Adam).
  TORCH_ARG(bool, adam_w_mode) = true;
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, maximize) = false;
  // fp32 masters of fp16/bf16 params, updated with the model copy in the same pass.
  TORCH_ARG(bool, master_weights) = false;
  // Moments in float32 or bfloat16 (halves their memory; a mixprec extension).
  TORCH_ARG(c10::ScalarType, state_dtype) = c10::kFloat;

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

// torch::optim::AdamWOptions' defaults (weight_decay 1e-2) for FusedAdamW.
struct FusedAdamWOptions : public FusedAdamOptions {
  FusedAdamWOptions(double lr = 1e-3);  // NOLINT
};

struct FusedAdamParamState : public FusedCloneableParamState<FusedAdamParamState> {
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq);  // amsgrad only

 public:
  std::vector<Slot> slots() override;
};

class FusedAdam : public FusedOptimizer {
  MIXPREC_FUSED_OPTIMIZER_CLONE(FusedAdam, FusedAdamOptions)

 public:
  explicit FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedAdamOptions defaults = {});
  explicit FusedAdam(std::vector<at::Tensor> params, FusedAdamOptions defaults = {});

 protected:
  FusedAdam(std::string name, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
            FusedAdamOptions defaults);
  std::unique_ptr<FusedParamState> make_state() const override;
  std::unique_ptr<FusedOptions> make_options() const override;
  const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const override;
  void init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) override;
  void step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                  const StepArgs& args) override;
  at::Tensor checked_state_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                  const at::Tensor& param, const FusedOptions& options) const override;

  bool decoupled_only_ = false;  // FusedAdamW: every group must have adam_w_mode
};

// AdamW: FusedAdam with decoupled weight decay, defaulting to torch::optim::AdamW's 1e-2. A
// drop-in for torch::optim::AdamW (same update; fp32 results agree to rounding).
class FusedAdamW : public FusedAdam {
  MIXPREC_FUSED_OPTIMIZER_CLONE(FusedAdamW, FusedAdamOptions)

 public:
  explicit FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      FusedAdamOptions defaults = FusedAdamWOptions());
  explicit FusedAdamW(std::vector<at::Tensor> params, FusedAdamOptions defaults = FusedAdamWOptions());

 protected:
  std::unique_ptr<FusedOptions> make_options() const override;  // FusedAdamWOptions' defaults
};

}  // namespace mixprec::optim
