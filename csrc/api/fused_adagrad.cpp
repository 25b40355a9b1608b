// FusedAdagrad for LibTorch (include/mixprec/optim/fused_adagrad.h): options, state and the call of
// mixprec::adagrad_ that python/mixprec/optimizers/fused_adagrad.py makes.
#include <mixprec/optim/fused_adagrad.h>

#include <ATen/ATen.h>

#include "api/api_util.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

FusedAdagradOptions::FusedAdagradOptions(double lr) : lr_(lr) {}

std::unique_ptr<torch::optim::OptimizerOptions> FusedAdagradOptions::clone() const {
  return std::make_unique<FusedAdagradOptions>(*this);
}

void FusedAdagradOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr_));
  archive.write("eps", c10::IValue(eps_));
  archive.write("weight_decay", c10::IValue(weight_decay_));
  archive.write("adagrad_w_mode", c10::IValue(adagrad_w_mode_));
  archive.write("lr_decay", c10::IValue(lr_decay_));
  archive.write("initial_accumulator_value", c10::IValue(initial_accumulator_value_));
  archive.write("maximize", c10::IValue(maximize_));
  archive.write("master_weights", c10::IValue(master_weights_));
}

void FusedAdagradOptions::serialize(torch::serialize::InputArchive& archive) {
  const std::string w = "FusedAdagradOptions";
  lr_ = read_double(archive, "lr", w);
  eps_ = read_double(archive, "eps", w);
  weight_decay_ = read_double(archive, "weight_decay", w);
  adagrad_w_mode_ = read_bool(archive, "adagrad_w_mode", w);
  lr_decay_ = read_double(archive, "lr_decay", w);
  initial_accumulator_value_ = read_double(archive, "initial_accumulator_value", w);
  maximize_ = read_bool(archive, "maximize", w);
  master_weights_ = read_bool(archive, "master_weights", w);
}

void FusedAdagradOptions::inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh_options) {
  const auto& d = static_cast<const FusedAdagradOptions&>(defaults);
  const auto& fresh = static_cast<const FusedAdagradOptions&>(fresh_options);
  MIXPREC_INHERIT_UNSET(lr);
  MIXPREC_INHERIT_UNSET(eps);
  MIXPREC_INHERIT_UNSET(weight_decay);
  MIXPREC_INHERIT_UNSET(adagrad_w_mode);
  MIXPREC_INHERIT_UNSET(lr_decay);
  MIXPREC_INHERIT_UNSET(initial_accumulator_value);
  MIXPREC_INHERIT_UNSET(maximize);
  MIXPREC_INHERIT_UNSET(master_weights);
}

void FusedAdagradOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr_);
  check_finite_nonneg(where, "eps", eps_);
  check_finite_nonneg(where, "weight_decay", weight_decay_);
  check_finite_nonneg(where, "lr_decay", lr_decay_);
  check_finite_nonneg(where, "initial_accumulator_value", initial_accumulator_value_);
}

std::vector<FusedParamState::Slot> FusedAdagradParamState::slots() {
  return {{"master_param", &master_param()}, {"sum", &sum_}};
}

FusedAdagrad::FusedAdagrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                           FusedAdagradOptions defaults)
    : FusedOptimizer("FusedAdagrad", param_groups, std::make_unique<FusedAdagradOptions>(defaults)) {
  finish_construction();
}

FusedAdagrad::FusedAdagrad(std::vector<at::Tensor> params, FusedAdagradOptions defaults)
    : FusedAdagrad({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

std::unique_ptr<FusedParamState> FusedAdagrad::make_state() const {
  return std::make_unique<FusedAdagradParamState>();
}

std::unique_ptr<FusedOptions> FusedAdagrad::make_options() const { return std::make_unique<FusedAdagradOptions>(); }

const FusedOptions* FusedAdagrad::cast_options(const torch::optim::OptimizerOptions& o) const {
  return dynamic_cast<const FusedAdagradOptions*>(&o);
}

void FusedAdagrad::init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) {
  const auto& o = static_cast<const FusedAdagradOptions&>(options);
  auto& s = static_cast<FusedAdagradParamState&>(state);
  if (!s.sum().defined())
    s.sum(at::full_like(p, o.initial_accumulator_value(), at::TensorOptions().dtype(at::kFloat),
                        at::MemoryFormat::Contiguous));
}

void FusedAdagrad::step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                              const StepArgs& args) {
  const auto& o = static_cast<const FusedAdagradOptions&>(options);
  std::vector<at::Tensor> grads, sums;
  for (const auto& p : params) {
    grads.push_back(p.grad());
    sums.push_back(state_as<FusedAdagradParamState>(p).sum());
  }
  AdagradArgs a;
  a.eps = o.eps();
  a.weight_decay = o.weight_decay();
  a.lr_decay = o.lr_decay();
  a.adagrad_w_mode = o.adagrad_w_mode();
  a.maximize = o.maximize();
  mixprec::adagrad_(params, grads, sums, masters(params, options), a, args);
}

}  // namespace mixprec::optim
