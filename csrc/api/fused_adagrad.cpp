// FusedAdagrad for LibTorch (include/mixprec/optim/fused_adagrad.h): options, state and the call of
// mixprec::adagrad_ that python/mixprec/optimizers/fused_adagrad.py makes.
#include <mixprec/optim/fused_adagrad.h>

#include <ATen/ATen.h>

#include "api/fused_options_impl.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

template class FusedOptionsFor<FusedAdagradOptions, AdagradArgs>;

void FusedAdagradOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr());
  check_finite_nonneg(where, "eps", eps());
  check_finite_nonneg(where, "weight_decay", weight_decay());
  check_finite_nonneg(where, "lr_decay", lr_decay());
  check_finite_nonneg(where, "initial_accumulator_value", initial_accumulator_value());
}

FusedAdagrad::FusedAdagrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                           FusedAdagradOptions defaults)
    : FusedOptimizerOf("FusedAdagrad", param_groups, std::make_unique<FusedAdagradOptions>(defaults)) {
  finish_construction();
}

void FusedAdagrad::init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) {
  auto& s = static_cast<FusedAdagradParamState&>(state);
  if (!s.sum().defined()) s.sum(state_zeros(p).fill_(options_as(options).initial_accumulator_value()));
}

void FusedAdagrad::step_group(size_t, const GroupLists& l, const FusedOptions& options, const StepArgs& args) {
  mixprec::adagrad_(l.params, l.grads, l.slot("sum"), l.masters, options_as(options).args(), args);
}

}  // namespace mixprec::optim
