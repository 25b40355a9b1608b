// FusedSGD for LibTorch (include/mixprec/optim/fused_sgd.h): options, state and the calls of
// mixprec::sgd_ that python/mixprec/optimizers/fused_sgd.py makes, new momentum buffers included.
#include <mixprec/optim/fused_sgd.h>

#include <ATen/ATen.h>

#include <cstring>

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
  const bool momentum = o.momentum() != 0;
  const SgdArgs a = o.args();
  // The lists hold the state's buffers as they are (a replaced one means rebuilt lists).
  std::vector<size_t> fresh;  // positions whose param has no buffer yet
  if (momentum) {
    const auto& buffers = l.slot("momentum_buffer");
    for (size_t k = 0; k < buffers.size(); ++k)
      if (!buffers[k].defined()) fresh.push_back(k);
  }
  if (fresh.empty()) {  // every buffer existed when the lists were built
    mixprec::sgd_(l.params, l.grads, momentum ? at::TensorList(l.slot("momentum_buffer")) : at::TensorList(), l.masters,
                  a, args);
    return;
  }
  // New buffers: zeros made here and given to the state only once the op has taken them (a check
  // keeps none: the step must see them as new). The next step rebuilds the lists.
  std::vector<at::Tensor> buffers = l.slot("momentum_buffer");
  for (size_t k : fresh) buffers[k] = state_zeros(l.params[k], momentum_dtype(l.params[k], o));
  // The op over the entries at `positions` (all of them when null).
  const auto run = [&](const std::vector<size_t>* positions, const StepArgs& s) {
    if (positions == nullptr) {
      mixprec::sgd_(l.params, l.grads, buffers, l.masters, a, s);
      return;
    }
    std::vector<at::Tensor> ps, gs, bs, ms;
    for (size_t k : *positions) {
      ps.push_back(l.params[k]);
      gs.push_back(l.grads[k]);
      bs.push_back(buffers[k]);
      if (!l.masters.empty()) ms.push_back(l.masters[k]);
    }
    mixprec::sgd_(ps, gs, bs, ms, a, s);
  };
  // torch::optim::SGD starts a new buffer at the gradient; the op does so on the group's first
  // step. With dampening 0 a zero buffer gives the gradient anyway (momentum * 0 + g), but
  // otherwise buffers new to a group past its first step need a step of their own: a host step
  // of 1, skipped with found_inf like the rest, so no host sync either way.
  if (o.dampening() == 0) {
    run(nullptr, args);
  } else {
    std::vector<size_t> rest;
    for (size_t k = 0, f = 0; k < l.params.size(); ++k) {
      if (f < fresh.size() && fresh[f] == k) {
        ++f;
      } else {
        rest.push_back(k);
      }
    }
    StepArgs first = args;
    first.step_tensor = std::nullopt;
    first.step = 1;
    // Two calls: the second is checked before the first writes (step() checked both already for
    // every group but its first; this path is rare: buffers new past a group's first step).
    if (!args.validate_only && !rest.empty()) {
      StepArgs check_first = first, check_rest = args;
      check_first.validate_only = check_rest.validate_only = true;
      run(&fresh, check_first);
      run(&rest, check_rest);
    }
    run(&fresh, first);
    if (!rest.empty()) {
      run(&rest, args);
    } else if (!args.validate_only) {
      // The op counts steps on the device; with no call taking the step tensor, count here.
      if (args.found_inf) {
        args.step_tensor->add_(args.found_inf->eq(0).to(at::kFloat));
      } else {
        args.step_tensor->add_(1.0);
      }
    }
  }
  if (args.validate_only) return;
  for (size_t k : fresh) state_as<FusedSGDParamState>(l.params[k]).momentum_buffer(buffers[k]);
}

}  // namespace mixprec::optim
