// FusedAdam / FusedAdamW for LibTorch (include/mixprec/optim/fused_adam.h): options, state and the
// call of mixprec::adam_ with the arguments python/mixprec/optimizers/fused_adam.py passes.
#include <mixprec/optim/fused_adam.h>

#include <ATen/ATen.h>

#include "api/fused_options_impl.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

// ---- options -----------------------------------------------------------------------------------
template class FusedOptionsFor<FusedAdamOptions, AdamArgs>;

FusedAdamWOptions::FusedAdamWOptions(double lr) : FusedAdamOptions(lr) {
  weight_decay(1e-2);
  adam_w_mode(true);
  forget_named();  // AdamW's defaults, not a group's choices: a group may still inherit them
}

void FusedAdamOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr());
  check_finite_nonneg(where, "eps", eps());
  check_betas(where, betas());
  check_finite_nonneg(where, "weight_decay", weight_decay());
  MIXPREC_CHECK_VALUE(state_dtype() == c10::kFloat || state_dtype() == c10::kBFloat16, where,
                      ": state_dtype must be float32 or bfloat16, got ", c10::toString(state_dtype()));
}

// ---- optimizer ---------------------------------------------------------------------------------
FusedAdam::FusedAdam(std::string name, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedAdamOptions defaults)
    : FusedOptimizerOf(std::move(name), param_groups, std::make_unique<FusedAdamOptions>(defaults)) {}

FusedAdam::FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedAdamOptions defaults)
    : FusedAdam("FusedAdam", param_groups, std::move(defaults)) {
  finish_construction();
}

FusedAdamW::FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedAdamOptions defaults)
    : FusedAdam("FusedAdamW", param_groups, std::move(defaults)) {
  decoupled_only_ = true;
  finish_construction();
}

std::unique_ptr<FusedOptions> FusedAdamW::make_options() const { return std::make_unique<FusedAdamWOptions>(); }

const FusedOptions* FusedAdam::cast_options(const torch::optim::OptimizerOptions& o) const {
  const auto* a = static_cast<const FusedAdamOptions*>(FusedOptimizerOf::cast_options(o));
  // FusedAdamW is AdamW: a group asking for L2 decay is a mistake worth stopping at.
  MIXPREC_CHECK_VALUE(a == nullptr || !decoupled_only_ || a->adam_w_mode(), name(),
                      ": adam_w_mode must stay true (use FusedAdam for Adam's L2 weight decay)");
  return a;
}

void FusedAdam::init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) {
  const auto& o = options_as(options);
  auto& s = static_cast<FusedAdamParamState&>(state);
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros(p, o.state_dtype()));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros(p, o.state_dtype()));
  // A group switched to amsgrad after its first step starts its maximum at the current moment.
  if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(s.exp_avg_sq().clone());
}

void FusedAdam::step_group(size_t, const GroupLists& l, const FusedOptions& options, const StepArgs& args) {
  const auto& o = options_as(options);
  mixprec::adam_(l.params, l.grads, l.slot("exp_avg"), l.slot("exp_avg_sq"),
                 o.amsgrad() ? at::TensorList(l.slot("max_exp_avg_sq")) : at::TensorList(), l.masters, o.args(), args);
}

at::Tensor FusedAdam::checked_state_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                           const at::Tensor& param, const FusedOptions& options) const {
  // Moments may be bfloat16 (state_dtype); the op wants all three of a param in one dtype, so
  // they are converted to the group's state_dtype.
  const auto& o = options_as(options);
  MIXPREC_CHECK_TYPE(value.scalar_type() == at::kFloat || value.scalar_type() == at::kBFloat16, where,
                     " must be float32 or bfloat16, got ", value.scalar_type());
  return value.to(o.state_dtype());
}

}  // namespace mixprec::optim
