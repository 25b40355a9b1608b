// mixprec::optim::FusedSGD: SGD with momentum, dampening, Nesterov and weight decay in one fused
// mixprec::sgd_ pass per param group; the C++ twin of python/mixprec/optimizers/fused_sgd.py.
#pragma once

#include <mixprec/optim/fused_options.h>

namespace mixprec::optim {

// state_dtype of FusedSGDOptions that keeps each momentum buffer in the dtype of the weight the
// step updates (Python's state_dtype="param"): the param's own, float32 where it has a master.
inline constexpr c10::ScalarType kMomentumInParamDtype = c10::ScalarType::Undefined;

// state_dtype: c10::kFloat (float32 buffers, the default) or kMomentumInParamDtype (Apex's and
// torch::optim::SGD's storage: an fp16/bf16 param's buffer in its dtype, see kernels/sgd.h).
#define MIXPREC_FUSED_SGD_OWN_OPTIONS(X) \
  X(double, lr, 0.0)                     \
  MIXPREC_FUSED_WEIGHT_OPTIONS(X)        \
  X(c10::ScalarType, state_dtype, c10::kFloat)

// torch::optim::SGDOptions' fields plus Apex's wd_after_momentum (decay added to the
// momentum-filtered direction instead of to the gradient); lr has no default, as in torch.
struct MIXPREC_API FusedSGDOptions : public FusedOptionsFor<FusedSGDOptions, SgdArgs> {
  FusedSGDOptions(double lr) { this->lr(lr); }  // NOLINT: implicit like torch::optim::SGDOptions
  MIXPREC_FUSED_OPTIONS_FIELDS(FusedSGDOptions, MIXPREC_SGD_ARGS, MIXPREC_FUSED_SGD_OWN_OPTIONS)
  static constexpr bool lr_has_default = false;
  void check(const std::string& where) const override;
};
extern template class FusedOptionsFor<FusedSGDOptions, SgdArgs>;

// In momentum_dtype(); made at the param's first step with momentum.
#define MIXPREC_FUSED_SGD_STATE(X) X(momentum_buffer)
MIXPREC_FUSED_PARAM_STATE(FusedSGDParamState, MIXPREC_FUSED_SGD_STATE);

// torch::optim::SGD's numerics (a new momentum buffer starts as the gradient itself).
class MIXPREC_API FusedSGD : public FusedOptimizerOf<FusedSGDOptions, FusedSGDParamState> {
  MIXPREC_FUSED_OPTIMIZER_CLASS(FusedSGD, FusedSGDOptions, )
  MIXPREC_FUSED_OPTIMIZER_STEP()

 public:
  // The dtype of param's momentum buffer under `options` (see state_dtype).
  static c10::ScalarType momentum_dtype(const at::Tensor& param, const FusedSGDOptions& options);

 protected:
  at::Tensor checked_state_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                  const at::Tensor& param, const FusedOptions& options) const override;
};

}  // namespace mixprec::optim
