// mixprec::optim::FusedAdagrad: Adagrad (L2 or decoupled decay) in one fused mixprec::adagrad_ pass
// per param group; the C++ twin of python/mixprec/optimizers/fused_adagrad.py.
#pragma once

#include <mixprec/optim/fused_options.h>

namespace mixprec::optim {

#define MIXPREC_FUSED_ADAGRAD_OWN_OPTIONS(X) \
  X(double, lr, 1e-2)                        \
  X(double, initial_accumulator_value, 0.0)  \
  MIXPREC_FUSED_WEIGHT_OPTIONS(X)

// Apex's FusedAdagrad defaults (adagrad_w_mode: decoupled decay, w -= lr * (g / (sqrt(sum) + eps)
// + weight_decay * w)) plus torch::optim::AdagradOptions' lr_decay and initial_accumulator_value,
// and maximize.
struct MIXPREC_API FusedAdagradOptions : public FusedOptionsFor<FusedAdagradOptions, AdagradArgs> {
  FusedAdagradOptions(double lr = 1e-2) { this->lr(lr); }  // NOLINT
  MIXPREC_FUSED_OPTIONS_FIELDS(FusedAdagradOptions, MIXPREC_ADAGRAD_ARGS, MIXPREC_FUSED_ADAGRAD_OWN_OPTIONS)
  void check(const std::string& where) const override;
};
extern template class FusedOptionsFor<FusedAdagradOptions, AdagradArgs>;

// float32 sums of squared gradients.
#define MIXPREC_FUSED_ADAGRAD_STATE(X) X(sum)
MIXPREC_FUSED_PARAM_STATE(FusedAdagradParamState, MIXPREC_FUSED_ADAGRAD_STATE);

class MIXPREC_API FusedAdagrad : public FusedOptimizerOf<FusedAdagradOptions, FusedAdagradParamState> {
  MIXPREC_FUSED_OPTIMIZER_CLASS(FusedAdagrad, FusedAdagradOptions, = {})
  MIXPREC_FUSED_OPTIMIZER_STEP()
};

}  // namespace mixprec::optim
