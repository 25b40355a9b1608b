// FusedAdam / FusedAdamW for LibTorch (include/mixprec/optim/fused_adam.h): options, state and the
// call of mixprec::adam_ with the arguments python/mixprec/optimizers/fused_adam.py passes.
#include <mixprec/optim/fused_adam.h>

#include <ATen/ATen.h>

#include "api/api_util.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

// ---- options -----------------------------------------------------------------------------------
FusedAdamOptions::FusedAdamOptions(double lr) : lr_(lr) {}

FusedAdamWOptions::FusedAdamWOptions(double lr) : FusedAdamOptions(lr) {
  weight_decay(1e-2);
  adam_w_mode(true);
}

std::unique_ptr<torch::optim::OptimizerOptions> FusedAdamOptions::clone() const {
  return std::make_unique<FusedAdamOptions>(*this);
}

void FusedAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr_));
  write_betas(archive, betas_);
  archive.write("eps", c10::IValue(eps_));
  archive.write("weight_decay", c10::IValue(weight_decay_));
  archive.write("amsgrad", c10::IValue(amsgrad_));
  archive.write("adam_w_mode", c10::IValue(adam_w_mode_));
  archive.write("bias_correction", c10::IValue(bias_correction_));
  archive.write("maximize", c10::IValue(maximize_));
  archive.write("master_weights", c10::IValue(master_weights_));
  archive.write("state_dtype", c10::IValue(static_cast<int64_t>(state_dtype_)));
}

void FusedAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  const std::string w = "FusedAdamOptions";
  lr_ = read_double(archive, "lr", w);
  betas_ = read_betas(archive, w);
  eps_ = read_double(archive, "eps", w);
  weight_decay_ = read_double(archive, "weight_decay", w);
  amsgrad_ = read_bool(archive, "amsgrad", w);
  adam_w_mode_ = read_bool(archive, "adam_w_mode", w);
  bias_correction_ = read_bool(archive, "bias_correction", w);
  maximize_ = read_bool(archive, "maximize", w);
  master_weights_ = read_bool(archive, "master_weights", w);
  const int64_t dt = read_int(archive, "state_dtype", w);
  TORCH_CHECK_VALUE(dt == static_cast<int64_t>(c10::kFloat) || dt == static_cast<int64_t>(c10::kBFloat16), w,
                    ": 'state_dtype' must be float32 or bfloat16, got code ", detail::num(dt));
  state_dtype_ = static_cast<c10::ScalarType>(dt);
}

void FusedAdamOptions::inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh_options) {
  const auto& d = static_cast<const FusedAdamOptions&>(defaults);
  const auto& fresh = static_cast<const FusedAdamOptions&>(fresh_options);
  MIXPREC_INHERIT_UNSET(lr);
  MIXPREC_INHERIT_UNSET(betas);
  MIXPREC_INHERIT_UNSET(eps);
  MIXPREC_INHERIT_UNSET(weight_decay);
  MIXPREC_INHERIT_UNSET(amsgrad);
  MIXPREC_INHERIT_UNSET(adam_w_mode);
  MIXPREC_INHERIT_UNSET(bias_correction);
  MIXPREC_INHERIT_UNSET(maximize);
  MIXPREC_INHERIT_UNSET(master_weights);
  MIXPREC_INHERIT_UNSET(state_dtype);
}

void FusedAdamOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr_);
  check_finite_nonneg(where, "eps", eps_);
  check_betas(where, betas_);
  check_finite_nonneg(where, "weight_decay", weight_decay_);
  TORCH_CHECK_VALUE(state_dtype_ == c10::kFloat || state_dtype_ == c10::kBFloat16, where,
                    ": state_dtype must be float32 or bfloat16, got ", state_dtype_);
}

std::vector<FusedParamState::Slot> FusedAdamParamState::slots() {
  return {{"master_param", &master_param()}, {"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_},
          {"max_exp_avg_sq", &max_exp_avg_sq_}};
}

// ---- optimizer ---------------------------------------------------------------------------------
FusedAdam::FusedAdam(std::string name, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedAdamOptions defaults)
    : FusedOptimizer(std::move(name), param_groups, std::make_unique<FusedAdamOptions>(defaults)) {}

FusedAdam::FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedAdamOptions defaults)
    : FusedAdam("FusedAdam", param_groups, std::move(defaults)) {
  finish_construction();
}

FusedAdam::FusedAdam(std::vector<at::Tensor> params, FusedAdamOptions defaults)
    : FusedAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

FusedAdamW::FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedAdamOptions defaults)
    : FusedAdam("FusedAdamW", param_groups, std::move(defaults)) {
  decoupled_only_ = true;
  finish_construction();
}

FusedAdamW::FusedAdamW(std::vector<at::Tensor> params, FusedAdamOptions defaults)
    : FusedAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

std::unique_ptr<FusedParamState> FusedAdam::make_state() const { return std::make_unique<FusedAdamParamState>(); }

std::unique_ptr<FusedOptions> FusedAdam::make_options() const { return std::make_unique<FusedAdamOptions>(); }

std::unique_ptr<FusedOptions> FusedAdamW::make_options() const { return std::make_unique<FusedAdamWOptions>(); }

const FusedOptions* FusedAdam::cast_options(const torch::optim::OptimizerOptions& o) const {
  const auto* a = dynamic_cast<const FusedAdamOptions*>(&o);
  // FusedAdamW is AdamW: a group asking for L2 decay is a mistake worth stopping at.
  TORCH_CHECK_VALUE(a == nullptr || !decoupled_only_ || a->adam_w_mode(), name(),
                    ": adam_w_mode must stay true (use FusedAdam for Adam's L2 weight decay)");
  return a;
}

void FusedAdam::init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) {
  const auto& o = static_cast<const FusedAdamOptions&>(options);
  auto& s = static_cast<FusedAdamParamState&>(state);
  const auto zeros = [&] {
    return at::zeros_like(p, at::TensorOptions().dtype(o.state_dtype()), at::MemoryFormat::Contiguous);
  };
  if (!s.exp_avg().defined()) s.exp_avg(zeros());
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(zeros());
  // A group switched to amsgrad after its first step starts its maximum at the current moment.
  if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(s.exp_avg_sq().clone());
}

void FusedAdam::step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                           const StepArgs& args) {
  const auto& o = static_cast<const FusedAdamOptions&>(options);
  std::vector<at::Tensor> grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  grads.reserve(params.size());
  exp_avgs.reserve(params.size());
  exp_avg_sqs.reserve(params.size());
  for (const auto& p : params) {
    auto& s = state_as<FusedAdamParamState>(p);
    grads.push_back(p.grad());
    exp_avgs.push_back(s.exp_avg());
    exp_avg_sqs.push_back(s.exp_avg_sq());
    if (o.amsgrad()) max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
  }
  AdamArgs a;
  a.beta1 = std::get<0>(o.betas());
  a.beta2 = std::get<1>(o.betas());
  a.eps = o.eps();
  a.weight_decay = o.weight_decay();
  a.adam_w_mode = o.adam_w_mode();
  a.bias_correction = o.bias_correction();
  a.maximize = o.maximize();
  mixprec::adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters(params, options), a, args);
}

at::Tensor FusedAdam::checked_state_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                           const at::Tensor& param, const FusedOptions& options) const {
  // Moments may be bfloat16 (state_dtype); the op wants all three of a param in one dtype, so
  // they are converted to the group's state_dtype.
  const auto& o = static_cast<const FusedAdamOptions&>(options);
  TORCH_CHECK_TYPE(value.scalar_type() == at::kFloat || value.scalar_type() == at::kBFloat16, where,
                   " must be float32 or bfloat16, got ", value.scalar_type());
  return value.to(o.state_dtype());
}

}  // namespace mixprec::optim
