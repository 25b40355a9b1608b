// FusedAdam / FusedAdamW for LibTorch (include/mixprec/optim/fused_adam.h): options, state and the
// call of mixprec::adam_ with the arguments python/mixprec/optimizers/fused_adam.py passes.
#include <mixprec/optim/fused_adam.h>

#include <ATen/ATen.h>

#include "api/fused_options_impl.h"
#include "kernels/quant8.h"  // the 8-bit moments' block size

namespace mixprec::optim {

using namespace mixprec::detail::api;
using kernels::kQuantBlock;
using kernels::quant_blocks;

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
  MIXPREC_CHECK_VALUE(state_dtype() == c10::kFloat || state_dtype() == c10::kBFloat16 || state_dtype() == c10::kChar,
                      where, ": state_dtype must be float32, bfloat16 or int8 (8-bit block-quantized moments), got ",
                      c10::toString(state_dtype()));
  MIXPREC_CHECK_VALUE(!(amsgrad() && state_dtype() == c10::kChar), where,
                      ": amsgrad needs float32 or bfloat16 moments; 8-bit moments (state_dtype int8) keep no maximum");
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
  if (o.state_dtype() == c10::kChar) {  // 8-bit: int8 codes of m, uint8 codes of sqrt(v), their scales
    if (s.exp_avg().defined()) return;
    const int64_t blocks = quant_blocks(p.numel());
    s.exp_avg(state_zeros(p, at::kChar));
    s.exp_avg_sq(state_zeros(p, at::kByte));
    s.exp_avg_scale(at::zeros({blocks}, p.options().dtype(at::kFloat)));
    s.exp_avg_sq_scale(at::zeros({blocks}, p.options().dtype(at::kFloat)));
    return;
  }
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros(p, o.state_dtype()));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros(p, o.state_dtype()));
  // A group switched to amsgrad after its first step starts its maximum at the current moment.
  if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(s.exp_avg_sq().clone());
}

void FusedAdam::step_group(size_t, const GroupLists& l, const FusedOptions& options, const StepArgs& args) {
  const auto& o = options_as(options);
  const bool q8 = o.state_dtype() == c10::kChar;
  mixprec::adam_(l.params, l.grads, l.slot("exp_avg"), l.slot("exp_avg_sq"),
                 o.amsgrad() ? at::TensorList(l.slot("max_exp_avg_sq")) : at::TensorList(), l.masters, o.args(), args,
                 q8 ? at::TensorList(l.slot("exp_avg_scale")) : at::TensorList(),
                 q8 ? at::TensorList(l.slot("exp_avg_sq_scale")) : at::TensorList());
}

bool FusedAdam::checks_own_slot(const std::string& key, const at::Tensor& value) const {
  return key == "exp_avg_scale" || key == "exp_avg_sq_scale" || value.scalar_type() == at::kChar ||
         value.scalar_type() == at::kByte;
}

at::Tensor FusedAdam::checked_state_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                           const at::Tensor& param, const FusedOptions& options) const {
  const auto& o = options_as(options);
  // 8-bit moments load only into a group whose state_dtype is int8 (restored from the checkpoint
  // with the other options), as they were saved: codes and scales convert together or not at all.
  const bool q8_key = key == "exp_avg_scale" || key == "exp_avg_sq_scale";
  const bool q8_value = value.scalar_type() == at::kChar || value.scalar_type() == at::kByte;
  if (o.state_dtype() == c10::kChar || q8_key || q8_value) {
    MIXPREC_CHECK_VALUE(o.state_dtype() == c10::kChar && key != "max_exp_avg_sq", where,
                        " is not state of the group's moments (state_dtype ", c10::toString(o.state_dtype()),
                        "); 8-bit moments (int8) and float moments do not convert into one another here");
    if (q8_key) {
      const int64_t blocks = quant_blocks(param.numel());
      MIXPREC_CHECK_TYPE(value.scalar_type() == at::kFloat, where, " must be float32, got ", value.scalar_type());
      MIXPREC_CHECK_VALUE(value.dim() == 1 && value.numel() == blocks, where, " has shape ",
                          detail::shape(value.sizes()), "; expected [", detail::num(blocks), "], one scale per ",
                          detail::num(kQuantBlock), " elements of the parameter");
      return value;
    }
    const at::ScalarType want = key == "exp_avg" ? at::kChar : at::kByte;
    MIXPREC_CHECK_TYPE(value.scalar_type() == want, where, " must be ", want, " codes, got ", value.scalar_type());
    MIXPREC_CHECK_VALUE(value.sizes() == param.sizes(), where, " has shape ", detail::shape(value.sizes()),
                        " but the parameter has ", detail::shape(param.sizes()));
    return value;
  }
  // Moments may be bfloat16 (state_dtype); the op wants all three of a param in one dtype, so
  // they are converted to the group's state_dtype.
  MIXPREC_CHECK_TYPE(value.scalar_type() == at::kFloat || value.scalar_type() == at::kBFloat16, where,
                     " must be float32 or bfloat16, got ", value.scalar_type());
  return value.to(o.state_dtype());
}

}  // namespace mixprec::optim
