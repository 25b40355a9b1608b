// mixprec::optim::FusedLAMB: LAMB with global-norm clipping and NVLAMB in fused mixprec::lamb_
// passes; the C++ twin of python/mixprec/optimizers/fused_lamb.py (same defaults, same ops).
#pragma once

#include <c10/core/Device.h>

#include <utility>
#include <vector>

#include <mixprec/optim/fused_options.h>

namespace mixprec::optim {

#define MIXPREC_FUSED_LAMB_OWN_OPTIONS(X) \
  X(double, lr, 1e-3)                     \
  MIXPREC_FUSED_WEIGHT_OPTIONS(X)

// Apex's FusedLAMB defaults. max_grad_norm 0 (or inf) turns clipping off.
struct MIXPREC_API FusedLAMBOptions : public FusedOptionsFor<FusedLAMBOptions, LambArgs> {
  FusedLAMBOptions(double lr = 1e-3) { this->lr(lr); }  // NOLINT
  MIXPREC_FUSED_OPTIONS_FIELDS(FusedLAMBOptions, MIXPREC_LAMB_ARGS, MIXPREC_FUSED_LAMB_OWN_OPTIONS)
  void check(const std::string& where) const override;
  bool clips() const;
};
extern template class FusedOptionsFor<FusedLAMBOptions, LambArgs>;

#define MIXPREC_FUSED_LAMB_STATE(X) X(exp_avg) X(exp_avg_sq)
MIXPREC_FUSED_PARAM_STATE(FusedLAMBParamState, MIXPREC_FUSED_LAMB_STATE);

// Each step first takes the unscaled L2 norm of every gradient of every group together (on the
// device), then per group the Adam moments and the trust-ratio update (see fused_lamb.py).
class MIXPREC_API FusedLAMB : public FusedOptimizerOf<FusedLAMBOptions, FusedLAMBParamState> {
  MIXPREC_FUSED_OPTIMIZER_CLASS(FusedLAMB, FusedLAMBOptions, = {})
  MIXPREC_FUSED_OPTIMIZER_STEP()

 protected:
  void begin_step() override;
  void end_step() noexcept override;

 private:
  // The global gradient norm of this step, one copy per device in use.
  std::vector<std::pair<c10::Device, at::Tensor>> grad_norms_;
};

}  // namespace mixprec::optim
