// mixprec::optim::FusedSGD: SGD with momentum, dampening, Nesterov and weight decay in one fused
// mixprec::sgd_ pass per param group; the C++ twin of python/mixprec/optimizers/fused_sgd.py.
#pragma once

#include <mixprec/optim/fused_options.h>

namespace mixprec::optim {

#define MIXPREC_FUSED_SGD_OWN_OPTIONS(X) \
  X(double, lr, 0.0)                     \
  X(bool, master_weights, false)         \
  X(bool, master_remainder, false)

// torch::optim::SGDOptions' fields plus Apex's wd_after_momentum (decay added to the
// momentum-filtered direction instead of to the gradient); lr has no default, as in torch.
struct MIXPREC_API FusedSGDOptions : public FusedOptionsFor<FusedSGDOptions, SgdArgs> {
  FusedSGDOptions(double lr) { this->lr(lr); }  // NOLINT: implicit like torch::optim::SGDOptions
  MIXPREC_FUSED_OPTIONS_FIELDS(FusedSGDOptions, MIXPREC_SGD_ARGS, MIXPREC_FUSED_SGD_OWN_OPTIONS)
  static constexpr bool lr_has_default = false;
  void check(const std::string& where) const override;
};
extern template class FusedOptionsFor<FusedSGDOptions, SgdArgs>;

// float32; made at the param's first step with momentum.
#define MIXPREC_FUSED_SGD_STATE(X) X(momentum_buffer)
MIXPREC_FUSED_PARAM_STATE(FusedSGDParamState, MIXPREC_FUSED_SGD_STATE);

// torch::optim::SGD's numerics (a new momentum buffer starts as the gradient itself).
class MIXPREC_API FusedSGD : public FusedOptimizerOf<FusedSGDOptions, FusedSGDParamState> {
  MIXPREC_FUSED_OPTIMIZER_CLASS(FusedSGD, FusedSGDOptions, )
  MIXPREC_FUSED_OPTIMIZER_STEP()
};

}  // namespace mixprec::optim
