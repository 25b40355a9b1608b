// FusedSGD for LibTorch (include/mixprec/optim/fused_sgd.h): options, state and the calls of
// mixprec::sgd_ that python/mixprec/optimizers/fused_sgd.py makes, new momentum buffers included.
#include <mixprec/optim/fused_sgd.h>

#include <ATen/ATen.h>

#include <cstring>
#include <unordered_set>

#include "api/fused_options_impl.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

// Checkpoints from before state_dtype keep the options' value (float32 buffers, as they had).
template <> struct internal::LaterOwnFields<FusedSGDOptions> {
  static bool has(const char* key) { return std::strcmp(key, "state_dtype") == 0; }
};

template class FusedOptionsFor<FusedSGDOptions, SgdArgs>;

void FusedSGDOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr());
  check_finite_nonneg(where, "momentum", momentum());
  check_finite_nonneg(where, "weight_decay", weight_decay());
  MIXPREC_CHECK_VALUE(std::isfinite(dampening()), where, ": invalid dampening ", detail::num(dampening()));
  MIXPREC_CHECK_VALUE(!nesterov() || (momentum() > 0 && dampening() == 0), where,
                      ": Nesterov momentum requires a momentum and zero dampening");
  MIXPREC_CHECK_VALUE(state_dtype() == c10::kFloat || state_dtype() == kMomentumInParamDtype, where,
                      ": state_dtype must be float32 or kMomentumInParamDtype, got ", c10::toString(state_dtype()));
}

c10::ScalarType FusedSGD::momentum_dtype(const at::Tensor& param, const FusedSGDOptions& o) {
  const bool low = param.scalar_type() != at::kFloat;
  if (o.state_dtype() == c10::kFloat || (low && (o.master_weights() || o.master_remainder()))) return at::kFloat;
  return param.scalar_type();
}

at::Tensor FusedSGD::checked_state_tensor(const std::string& where, const std::string&, const at::Tensor& value,
                                          const at::Tensor& param, const FusedOptions& options) const {
  // float32 or the param's dtype (torch::optim::SGD's checkpoints), converted to the group's choice.
  MIXPREC_CHECK_TYPE(value.scalar_type() == at::kFloat || value.scalar_type() == param.scalar_type(), where,
                     " must be float32 or the param's ", param.scalar_type(), ", got ", value.scalar_type());
  return value.to(momentum_dtype(param, options_as(options)));
}

FusedSGD::FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedSGDOptions defaults)
    : FusedOptimizerOf("FusedSGD", param_groups, std::make_unique<FusedSGDOptions>(defaults)) {
  finish_construction();
}

void FusedSGD::init_param_state(const at::Tensor&, const FusedOptions&, FusedParamState&) {
  // Momentum buffers are made in step_group, which must know which of them are new.
}

void FusedSGD::step_group(size_t, const GroupLists& l, const FusedOptions& options, const StepArgs& args) {
  const auto& o = options_as(options);
  const std::vector<at::Tensor>& params = l.params;
  const bool momentum = o.momentum() != 0;
  std::unordered_set<const void*> fresh;
  if (momentum) {
    // The lists hold the state's buffers as they are (a replaced one means rebuilt lists).
    const auto& buffers = l.slot("momentum_buffer");
    for (size_t k = 0; k < params.size(); ++k) {
      if (buffers[k].defined()) continue;
      state_as<FusedSGDParamState>(params[k]).momentum_buffer(state_zeros(params[k], momentum_dtype(params[k], o)));
      fresh.insert(params[k].unsafeGetTensorImpl());
    }
  }
  const SgdArgs a = o.args();
  const auto run = [&](const std::vector<at::Tensor>& ps, const StepArgs& s) {
    mixprec::sgd_(ps, grads_of(ps),
                  momentum ? gather(ps, [](auto& st) { return st.momentum_buffer(); }) : std::vector<at::Tensor>{},
                  masters(ps, options), a, s);
  };
  // torch::optim::SGD starts a new buffer at the gradient; the op does so on the group's first
  // step. With dampening 0 a zero buffer gives the gradient anyway (momentum * 0 + g), but
  // otherwise buffers new to a group past its first step need a step of their own: a host step
  // of 1, skipped with found_inf like the rest, so no host sync either way.
  if (fresh.empty()) {  // every buffer existed when the lists were built
    mixprec::sgd_(params, l.grads, momentum ? at::TensorList(l.slot("momentum_buffer")) : at::TensorList(), l.masters,
                  a, args);
    return;
  }
  // New buffers (made above, after the lists were built: the next step rebuilds them).
  if (o.dampening() == 0) {
    run(params, args);
    return;
  }
  std::vector<at::Tensor> fresh_params, rest;
  for (const auto& p : params) (fresh.count(p.unsafeGetTensorImpl()) ? fresh_params : rest).push_back(p);
  StepArgs first = args;
  first.step_tensor = std::nullopt;
  first.step = 1;
  run(fresh_params, first);
  if (!rest.empty()) {
    run(rest, args);
  } else if (args.found_inf) {
    // The op counts steps on the device; with no call taking the step tensor, count here.
    args.step_tensor->add_(args.found_inf->eq(0).to(at::kFloat));
  } else {
    args.step_tensor->add_(1.0);
  }
}

}  // namespace mixprec::optim
