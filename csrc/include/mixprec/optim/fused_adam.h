// mixprec::optim::FusedAdam and FusedAdamW: Adam/AdamW in one fused mixprec::adam_ pass per param
// group; the C++ twin of python/mixprec/optimizers/fused_adam.py (same defaults, same op).
#pragma once

#include <mixprec/optim/fused_options.h>

namespace mixprec::optim {

// Options of FusedAdam beyond mixprec::adam_'s hyper-parameters. state_dtype: moments in float32,
// bfloat16 (halves their memory) or c10::kChar (int8: 8-bit block-quantized moments, a quarter
// of float32's, no amsgrad; docs/optimizers.md) -- mixprec extensions, as in the Python front.
#define MIXPREC_FUSED_ADAM_OWN_OPTIONS(X) \
  X(double, lr, 1e-3)                     \
  X(bool, amsgrad, false)                 \
  MIXPREC_FUSED_WEIGHT_OPTIONS(X)         \
  X(c10::ScalarType, state_dtype, c10::kFloat)

// Apex's and the Python front's defaults: adam_w_mode=true (AdamW's decoupled decay; false: L2
// added to the gradient, Adam), weight_decay 0. master_weights: fp32 masters of fp16/bf16 params,
// updated with the model copy in the same pass.
struct MIXPREC_API FusedAdamOptions : public FusedOptionsFor<FusedAdamOptions, AdamArgs> {
  FusedAdamOptions(double lr = 1e-3) { this->lr(lr); }  // NOLINT: implicit like torch::optim::AdamOptions
  MIXPREC_FUSED_OPTIONS_FIELDS(FusedAdamOptions, MIXPREC_ADAM_ARGS, MIXPREC_FUSED_ADAM_OWN_OPTIONS)
  void check(const std::string& where) const override;
};
extern template class FusedOptionsFor<FusedAdamOptions, AdamArgs>;

// torch::optim::AdamWOptions' defaults (weight_decay 1e-2) for FusedAdamW.
struct MIXPREC_API FusedAdamWOptions : public FusedAdamOptions {
  FusedAdamWOptions(double lr = 1e-3);  // NOLINT
};

// Adam's moments (in state_dtype); max_exp_avg_sq with amsgrad only. With 8-bit moments exp_avg
// holds int8 and exp_avg_sq uint8 codes, and the scales one float32 per 256 elements each.
#define MIXPREC_FUSED_ADAM_STATE(X) X(exp_avg) X(exp_avg_sq) X(max_exp_avg_sq) X(exp_avg_scale) X(exp_avg_sq_scale)
MIXPREC_FUSED_PARAM_STATE(FusedAdamParamState, MIXPREC_FUSED_ADAM_STATE);

class MIXPREC_API FusedAdam : public FusedOptimizerOf<FusedAdamOptions, FusedAdamParamState> {
  MIXPREC_FUSED_OPTIMIZER_CLASS(FusedAdam, FusedAdamOptions, = {})
  MIXPREC_FUSED_OPTIMIZER_STEP()

 protected:
  FusedAdam(std::string name, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
            FusedAdamOptions defaults);
  const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const override;
  at::Tensor checked_state_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                  const at::Tensor& param, const FusedOptions& options) const override;
  bool checks_own_slot(const std::string& key, const at::Tensor& value) const override;

  bool decoupled_only_ = false;  // FusedAdamW: every group must have adam_w_mode
};

// AdamW: FusedAdam with decoupled weight decay, defaulting to torch::optim::AdamW's 1e-2. A
// drop-in for torch::optim::AdamW (same update; fp32 results agree to rounding).
class MIXPREC_API FusedAdamW : public FusedAdam {
  MIXPREC_FUSED_OPTIMIZER_CLASS(FusedAdamW, FusedAdamOptions, = FusedAdamWOptions())

 protected:
  std::unique_ptr<FusedOptions> make_options() const override;  // FusedAdamWOptions' defaults
};

}  // namespace mixprec::optim
