// FusedSGD for LibTorch (include/mixprec/optim/fused_sgd.h): options, state and the calls of
// mixprec::sgd_ that python/mixprec/optimizers/fused_sgd.py makes, new momentum buffers included.
#include <mixprec/optim/fused_sgd.h>

#include <ATen/ATen.h>

#include <unordered_set>

#include "api/api_util.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

FusedSGDOptions::FusedSGDOptions(double lr) : lr_(lr) {}

std::unique_ptr<torch::optim::OptimizerOptions> FusedSGDOptions::clone() const {
  return std::make_unique<FusedSGDOptions>(*this);
}

void FusedSGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr_));
  archive.write("momentum", c10::IValue(momentum_));
  archive.write("dampening", c10::IValue(dampening_));
  archive.write("weight_decay", c10::IValue(weight_decay_));
  archive.write("nesterov", c10::IValue(nesterov_));
  archive.write("wd_after_momentum", c10::IValue(wd_after_momentum_));
  archive.write("maximize", c10::IValue(maximize_));
  archive.write("master_weights", c10::IValue(master_weights_));
}

void FusedSGDOptions::serialize(torch::serialize::InputArchive& archive) {
  const std::string w = "FusedSGDOptions";
  lr_ = read_double(archive, "lr", w);
  momentum_ = read_double(archive, "momentum", w);
  dampening_ = read_double(archive, "dampening", w);
  weight_decay_ = read_double(archive, "weight_decay", w);
  nesterov_ = read_bool(archive, "nesterov", w);
  wd_after_momentum_ = read_bool(archive, "wd_after_momentum", w);
  maximize_ = read_bool(archive, "maximize", w);
  master_weights_ = read_bool(archive, "master_weights", w);
}

void FusedSGDOptions::inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh_options) {
  const auto& d = static_cast<const FusedSGDOptions&>(defaults);
  const auto& fresh = static_cast<const FusedSGDOptions&>(fresh_options);
  // lr has no constructor default (torch::optim::SGDOptions' rule): a group's lr is always its own.
  MIXPREC_INHERIT_UNSET(momentum);
  MIXPREC_INHERIT_UNSET(dampening);
  MIXPREC_INHERIT_UNSET(weight_decay);
  MIXPREC_INHERIT_UNSET(nesterov);
  MIXPREC_INHERIT_UNSET(wd_after_momentum);
  MIXPREC_INHERIT_UNSET(maximize);
  MIXPREC_INHERIT_UNSET(master_weights);
}

void FusedSGDOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr_);
  check_finite_nonneg(where, "momentum", momentum_);
  check_finite_nonneg(where, "weight_decay", weight_decay_);
  TORCH_CHECK_VALUE(std::isfinite(dampening_), where, ": invalid dampening ", detail::num(dampening_));
  TORCH_CHECK_VALUE(!nesterov_ || (momentum_ > 0 && dampening_ == 0), where,
                    ": Nesterov momentum requires a momentum and zero dampening");
}

std::vector<FusedParamState::Slot> FusedSGDParamState::slots() {
  return {{"master_param", &master_param()}, {"momentum_buffer", &momentum_buffer_}};
}

FusedSGD::FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedSGDOptions defaults)
    : FusedOptimizer("FusedSGD", param_groups, std::make_unique<FusedSGDOptions>(defaults)) {
  finish_construction();
}

FusedSGD::FusedSGD(std::vector<at::Tensor> params, FusedSGDOptions defaults)
    : FusedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

std::unique_ptr<FusedParamState> FusedSGD::make_state() const { return std::make_unique<FusedSGDParamState>(); }

std::unique_ptr<FusedOptions> FusedSGD::make_options() const { return std::make_unique<FusedSGDOptions>(0.0); }

const FusedOptions* FusedSGD::cast_options(const torch::optim::OptimizerOptions& o) const {
  return dynamic_cast<const FusedSGDOptions*>(&o);
}

void FusedSGD::init_param_state(const at::Tensor&, const FusedOptions&, FusedParamState&) {
  // Momentum buffers are made in step_group, which must know which of them are new.
}

void FusedSGD::step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                          const StepArgs& args) {
  const auto& o = static_cast<const FusedSGDOptions&>(options);
  const bool momentum = o.momentum() != 0;
  std::unordered_set<const void*> fresh;
  if (momentum) {
    for (const auto& p : params) {
      auto& s = state_as<FusedSGDParamState>(p);
      if (!s.momentum_buffer().defined()) {
        s.momentum_buffer(at::zeros_like(p, at::TensorOptions().dtype(at::kFloat), at::MemoryFormat::Contiguous));
        fresh.insert(p.unsafeGetTensorImpl());
      }
    }
  }
  SgdArgs a;
  a.momentum = o.momentum();
  a.dampening = o.dampening();
  a.weight_decay = o.weight_decay();
  a.nesterov = o.nesterov();
  a.wd_after_momentum = o.wd_after_momentum();
  a.maximize = o.maximize();
  const auto run = [&](const std::vector<at::Tensor>& ps, const StepArgs& s) {
    std::vector<at::Tensor> grads, buffers;
    for (const auto& p : ps) {
      grads.push_back(p.grad());
      if (momentum) buffers.push_back(state_as<FusedSGDParamState>(p).momentum_buffer());
    }
    mixprec::sgd_(ps, grads, buffers, masters(ps, options), a, s);
  };
  // torch::optim::SGD starts a new buffer at the gradient; the op does so on the group's first
  // step. With dampening 0 a zero buffer gives the gradient anyway (momentum * 0 + g), but
  // otherwise buffers new to a group past its first step need a step of their own: a host step
  // of 1, skipped with found_inf like the rest, so no host sync either way.
  if (fresh.empty() || o.dampening() == 0) {
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
