// The shared machinery of mixprec's C++ fused optimizers (include/mixprec/optim/fused_optimizer.h):
// the step loop, lazily created state and masters, and checkpoints validated before they load.
#include <mixprec/optim/fused_optimizer.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <utility>

#include "api/api_util.h"
#include "ops/device_copy.h"

namespace mixprec::optim {

using detail::api::group_where;

// ---- FusedParamState ------------------------------------------------------------------------
std::vector<std::pair<std::string, at::Tensor>> FusedParamState::defined_tensors() const {
  // slots() hands out pointers for reading and writing alike; nothing is written here.
  auto* self = const_cast<FusedParamState*>(this);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& slot : self->slots())
    if (slot.second->defined()) out.emplace_back(slot.first, *slot.second);
  return out;
}

void FusedParamState::serialize(torch::serialize::OutputArchive& archive) const {
  for (const auto& kv : defined_tensors()) archive.write(kv.first, kv.second, /*is_buffer=*/true);
}

void FusedParamState::serialize(torch::serialize::InputArchive& archive) {
  for (const auto& slot : slots()) {
    at::Tensor value;
    if (archive.try_read(slot.first, value, /*is_buffer=*/true)) *slot.second = value;
  }
}

// ---- FusedOptimizer: construction and accessors ------------------------------------------------
FusedOptimizer::FusedOptimizer(std::string name, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                               std::unique_ptr<FusedOptions> defaults)
    : Optimizer(param_groups, std::move(defaults)), name_("mixprec::optim::" + std::move(name)) {
  // torch 2.10+ merges a group's options with the defaults only for its own optimizer classes and
  // gives any other class's groups the bare defaults; the groups' own options are kept here and
  // merged by finish_construction(), once the family's virtual functions can be called.
  for (size_t i = 0; i < param_groups.size() && i < param_groups_.size(); ++i)
    if (param_groups[i].has_options()) pending_options_.emplace_back(i, param_groups[i].options().clone());
}

std::unique_ptr<torch::optim::OptimizerOptions> FusedOptimizer::completed_options(
    const torch::optim::OptimizerOptions& given, size_t group) const {
  std::unique_ptr<torch::optim::OptimizerOptions> out = given.clone();
  auto* o = const_cast<FusedOptions*>(cast_options(*out));
  MIXPREC_CHECK_TYPE(o != nullptr, group_where(name_, group),
                     " has options of another optimizer; give each group this optimizer's options class");
  const FusedOptions* d = cast_options(*defaults_);
  MIXPREC_CHECK_TYPE(d != nullptr, name_, ": the default options are of the wrong class");
  o->inherit_unset(*d, *make_options());
  o->check(group_where(name_, group));
  return out;
}

void FusedOptimizer::finish_construction() {
  const FusedOptions* d = cast_options(*defaults_);
  MIXPREC_CHECK_TYPE(d != nullptr, name_, ": the default options are of the wrong class");
  d->check(name_ + ": defaults");
  for (auto& pending : pending_options_)
    param_groups_[pending.first].set_options(completed_options(*pending.second, pending.first));
  pending_options_.clear();
  for (size_t i = 0; i < param_groups_.size(); ++i) options_of(i).check(group_where(name_, i));
}

void FusedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  std::unique_ptr<torch::optim::OptimizerOptions> options;
  if (param_group.has_options()) options = completed_options(param_group.options(), param_groups_.size());
  Optimizer::add_param_group(param_group);
  if (options) param_groups_.back().set_options(std::move(options));
  forget_plans();
}

const FusedOptions& FusedOptimizer::options_of(size_t group) const {
  MIXPREC_CHECK_INDEX(group < param_groups_.size(), name_, ": no param group ", detail::num(group), " (there are ",
                      detail::num(param_groups_.size()), ")");
  const auto& g = param_groups_[group];
  MIXPREC_CHECK(g.has_options(), group_where(name_, group), " has no options");
  const FusedOptions* o = cast_options(g.options());
  MIXPREC_CHECK_TYPE(o != nullptr, group_where(name_, group),
                     " has options of another optimizer; give each group this optimizer's options class");
  return *o;
}

FusedParamState& FusedOptimizer::state_of(const at::Tensor& p) {
  auto& slot = state_[p.unsafeGetTensorImpl()];
  if (!slot) slot = make_state();
  auto* s = dynamic_cast<FusedParamState*>(slot.get());
  MIXPREC_CHECK(s != nullptr, name_, ": a parameter's state is not this optimizer's");
  return *s;
}

at::Tensor& FusedOptimizer::group_tensor(size_t group, const std::string& key) {
  sync_group_slots();
  MIXPREC_CHECK_INDEX(group < group_tensors_.size(), name_, ": no param group ", detail::num(group));
  return group_tensors_[group][key];
}

void FusedOptimizer::sync_group_slots() const {
  // Groups are only ever appended (add_param_group); their slots follow.
  if (group_tensors_.size() < param_groups_.size()) group_tensors_.resize(param_groups_.size());
}

at::Tensor FusedOptimizer::group_tensor_or_none(size_t group, const std::string& key) const {
  sync_group_slots();
  MIXPREC_CHECK_INDEX(group < group_tensors_.size(), name_, ": no param group ", detail::num(group));
  const auto it = group_tensors_[group].find(key);
  return it == group_tensors_[group].end() ? at::Tensor() : it->second;
}

at::Tensor FusedOptimizer::step_count_tensor(size_t group) const { return group_tensor_or_none(group, "step"); }

int64_t FusedOptimizer::step_count(size_t group) const {
  const at::Tensor t = step_count_tensor(group);
  return t.defined() ? static_cast<int64_t>(t.item<double>()) : 0;
}

at::Tensor& FusedOptimizer::step_tensor_for(size_t group, const at::Device& device) {
  at::Tensor& t = group_tensor(group, "step");
  if (!t.defined()) {
    t = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  } else if (t.device() != device || t.scalar_type() != at::kFloat || t.dim() != 1) {
    t = t.to(device, at::kFloat).reshape({1});  // params moved since: follow them
  }
  return t;
}

GradScaling FusedOptimizer::scaling_on(const at::Device& device) const {
  const auto on_device = [&](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t || !t->defined()) return std::nullopt;
    at::Tensor v = detail::to_device(*t, device, at::kFloat);
    return v.dim() == 1 ? v : v.reshape({1});
  };
  return {on_device(scaling_.grad_scale), on_device(scaling_.found_inf)};
}

std::vector<at::Tensor> FusedOptimizer::grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  out.reserve(params.size());
  for (const auto& p : params) out.push_back(p.grad());
  return out;
}

at::Tensor FusedOptimizer::state_zeros(const at::Tensor& p, at::ScalarType dtype) {
  return at::zeros_like(p, at::TensorOptions().dtype(dtype), at::MemoryFormat::Preserve);
}

std::vector<at::Tensor> FusedOptimizer::masters(const std::vector<at::Tensor>& params, const FusedOptions& options) {
  std::vector<at::Tensor> out;
  if (!options.uses_master_weights()) return out;
  out.reserve(params.size());
  for (const auto& p : params) {
    const at::Tensor& m = state_of(p).master_param();
    out.push_back(m.defined() ? m : p);  // an fp32 param is its own master
  }
  return out;
}

std::vector<at::Tensor> FusedOptimizer::master_params() const {
  std::vector<at::Tensor> out;
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) {
      const auto it = state_.find(p.unsafeGetTensorImpl());
      const auto* s = it == state_.end() ? nullptr : dynamic_cast<const FusedParamState*>(it->second.get());
      // A remainder (int16) is no fp32 master: the bf16 param stands for it, as fp32 params do.
      const bool fp32 = s != nullptr && s->master_param().defined() && s->master_param().scalar_type() == at::kFloat;
      out.push_back(fp32 ? s->master_param() : p);
    }
  }
  return out;
}

void FusedOptimizer::set_master_weights(bool on) {
  auto* d = const_cast<FusedOptions*>(cast_options(*defaults_));
  MIXPREC_CHECK(d != nullptr, name_, ": the default options are of the wrong class");
  d->set_master_weights(on);
  for (size_t i = 0; i < param_groups_.size(); ++i) const_cast<FusedOptions&>(options_of(i)).set_master_weights(on);
  forget_plans();
}

void FusedOptimizer::set_master(const at::Tensor& param, const at::Tensor& master) {
  bool found = false;
  for (const auto& g : param_groups_)
    for (const auto& p : g.params()) found = found || p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl();
  MIXPREC_CHECK_VALUE(found, name_, ".set_master: the tensor is not a parameter of this optimizer");
  MIXPREC_CHECK_TYPE(master.scalar_type() == at::kFloat, name_, ".set_master: a master must be float32, got ",
                     master.scalar_type());
  MIXPREC_CHECK_VALUE(master.sizes() == param.sizes(), name_, ".set_master: the master has shape ",
                      detail::shape(master.sizes()), " but the parameter has ", detail::shape(param.sizes()));
  state_of(param).master_param(detail::api::copy_in_layout_of(master.detach(), param));
  forget_plans();
}

void FusedOptimizer::ensure_state(const at::Tensor& p, const FusedOptions& options) {
  FusedParamState& s = state_of(p);
  if (options.uses_master_weights() && p.scalar_type() != at::kFloat && !s.master_param().defined()) {
    // A zero remainder: the master is exactly the bf16 param (check_step_inputs: bf16 only).
    s.master_param(options.uses_master_remainder()
                       ? state_zeros(p, at::kShort)
                       : p.detach().to(at::kFloat, false, /*copy=*/true, at::MemoryFormat::Preserve));
  }
  init_param_state(p, options, s);
}

void FusedOptimizer::init_state() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const FusedOptions& o = options_of(i);
    for (const auto& p : param_groups_[i].params()) ensure_state(p, o);
  }
}

}  // namespace mixprec::optim
