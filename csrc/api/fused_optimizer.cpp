// The shared machinery of mixprec's C++ fused optimizers (include/mixprec/optim/fused_optimizer.h):
// the step loop, lazily created state and masters, and checkpoints validated before they load.
#include <mixprec/optim/fused_optimizer.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <cstdlib>
#include <set>
#include <utility>

#include "api/api_util.h"

namespace mixprec::optim {

namespace {
// The checkpoint layout's name and version, checked on load.
constexpr const char* kFormat = "mixprec.optim.v1";

std::string group_where(const std::string& name, size_t group) {
  return name + ": param_groups[" + std::to_string(group) + "]";
}
}  // namespace

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
  TORCH_CHECK_TYPE(o != nullptr, group_where(name_, group),
                   " has options of another optimizer; give each group this optimizer's options class");
  const FusedOptions* d = cast_options(*defaults_);
  TORCH_CHECK_TYPE(d != nullptr, name_, ": the default options are of the wrong class");
  o->inherit_unset(*d, *make_options());
  o->check(group_where(name_, group));
  return out;
}

void FusedOptimizer::finish_construction() {
  const FusedOptions* d = cast_options(*defaults_);
  TORCH_CHECK_TYPE(d != nullptr, name_, ": the default options are of the wrong class");
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
}

const FusedOptions& FusedOptimizer::options_of(size_t group) const {
  TORCH_CHECK_INDEX(group < param_groups_.size(), name_, ": no param group ", detail::num(group),
                    " (there are ", detail::num(param_groups_.size()), ")");
  const auto& g = param_groups_[group];
  TORCH_CHECK(g.has_options(), group_where(name_, group), " has no options");
  const FusedOptions* o = cast_options(g.options());
  TORCH_CHECK_TYPE(o != nullptr, group_where(name_, group),
                   " has options of another optimizer; give each group this optimizer's options class");
  return *o;
}

FusedParamState& FusedOptimizer::state_of(const at::Tensor& p) {
  auto& slot = state_[p.unsafeGetTensorImpl()];
  if (!slot) slot = make_state();
  auto* s = dynamic_cast<FusedParamState*>(slot.get());
  TORCH_CHECK(s != nullptr, name_, ": a parameter's state is not this optimizer's");
  return *s;
}

at::Tensor& FusedOptimizer::group_tensor(size_t group, const std::string& key) {
  sync_group_slots();
  TORCH_CHECK_INDEX(group < group_tensors_.size(), name_, ": no param group ", detail::num(group));
  return group_tensors_[group][key];
}

void FusedOptimizer::sync_group_slots() const {
  // Groups are only ever appended (add_param_group); their slots follow.
  if (group_tensors_.size() < param_groups_.size()) group_tensors_.resize(param_groups_.size());
}

at::Tensor FusedOptimizer::step_count_tensor(size_t group) const {
  sync_group_slots();
  TORCH_CHECK_INDEX(group < group_tensors_.size(), name_, ": no param group ", detail::num(group));
  const auto it = group_tensors_[group].find("step");
  return it == group_tensors_[group].end() ? at::Tensor() : it->second;
}

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
    at::Tensor v = t->to(device, at::kFloat, /*non_blocking=*/true);
    return v.dim() == 1 ? v : v.reshape({1});
  };
  return {on_device(scaling_.grad_scale), on_device(scaling_.found_inf)};
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
      out.push_back(s != nullptr && s->master_param().defined() ? s->master_param() : p);
    }
  }
  return out;
}

void FusedOptimizer::set_master_weights(bool on) {
  auto* d = const_cast<FusedOptions*>(cast_options(*defaults_));
  TORCH_CHECK(d != nullptr, name_, ": the default options are of the wrong class");
  d->set_master_weights(on);
  for (size_t i = 0; i < param_groups_.size(); ++i) const_cast<FusedOptions&>(options_of(i)).set_master_weights(on);
}

void FusedOptimizer::set_master(const at::Tensor& param, const at::Tensor& master) {
  bool found = false;
  for (const auto& g : param_groups_)
    for (const auto& p : g.params()) found = found || p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl();
  TORCH_CHECK_VALUE(found, name_, ".set_master: the tensor is not a parameter of this optimizer");
  TORCH_CHECK_TYPE(master.scalar_type() == at::kFloat, name_, ".set_master: a master must be float32, got ",
                   master.scalar_type());
  TORCH_CHECK_VALUE(master.sizes() == param.sizes(), name_, ".set_master: the master has shape ",
                    detail::shape(master.sizes()), " but the parameter has ", detail::shape(param.sizes()));
  state_of(param).master_param(
      master.detach().to(param.device(), at::kFloat, false, /*copy=*/true, at::MemoryFormat::Contiguous));
}

void FusedOptimizer::ensure_state(const at::Tensor& p, const FusedOptions& options) {
  FusedParamState& s = state_of(p);
  if (options.uses_master_weights() && p.scalar_type() != at::kFloat && !s.master_param().defined())
    s.master_param(p.detach().to(at::kFloat, false, /*copy=*/true, at::MemoryFormat::Contiguous));
  init_param_state(p, options, s);
}

void FusedOptimizer::init_state() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const FusedOptions& o = options_of(i);
    for (const auto& p : param_groups_[i].params()) ensure_state(p, o);
  }
}

// ---- step -------------------------------------------------------------------------------------
torch::Tensor FusedOptimizer::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  sync_group_slots();
  // Every group is checked before any op runs: a bad group leaves all of them as they were.
  struct Work {
    size_t index;
    const FusedOptions* options;
    std::vector<at::Tensor> params;
  };
  std::vector<Work> work;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const FusedOptions& o = options_of(i);
    o.check(group_where(name_, i));
    Work w{i, &o, {}};
    for (const auto& p : param_groups_[i].params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), name_, " does not support sparse gradients (param group ", detail::num(i),
                  ")");
      if (!w.params.empty())
        TORCH_CHECK_VALUE(p.device() == w.params[0].device(), group_where(name_, i), " mixes devices (",
                          w.params[0].device(), " and ", p.device(), "); put each device's params in its own group");
      w.params.push_back(p);
    }
    if (!w.params.empty()) work.push_back(std::move(w));
  }
  begin_step();
  struct EndStep {
    FusedOptimizer* self;
    ~EndStep() { self->end_step(); }
  } end_step_guard{this};
  for (const Work& w : work) {
    for (const auto& p : w.params) ensure_state(p, *w.options);
    const at::Device device = w.params[0].device();
    StepArgs args;
    args.lr = w.options->get_lr();
    args.step_tensor = step_tensor_for(w.index, device);
    const GradScaling s = scaling_on(device);
    args.grad_scale = s.grad_scale;
    args.found_inf = s.found_inf;
    step_group(w.index, w.params, *w.options, args);
  }
  return loss;
}

// ---- checkpoints ------------------------------------------------------------------------------
void FusedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  sync_group_slots();
  archive.write("mixprec_format", c10::IValue(std::string(kFormat)));
  archive.write("optimizer", c10::IValue(name_));
  archive.write("param_groups/size", c10::IValue(static_cast<int64_t>(param_groups_.size())));
  torch::serialize::OutputArchive state_archive(archive.compilation_unit());
  int64_t index = 0;  // params are numbered across groups, as in a Python state_dict
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto& g = param_groups_[i];
    torch::serialize::OutputArchive group_archive(archive.compilation_unit());
    group_archive.write("params/size", c10::IValue(static_cast<int64_t>(g.params().size())));
    torch::serialize::OutputArchive options_archive(archive.compilation_unit());
    options_of(i).serialize(options_archive);
    group_archive.write("options", options_archive);
    torch::serialize::OutputArchive tensors_archive(archive.compilation_unit());
    for (const auto& kv : group_tensors_[i])
      if (kv.second.defined()) tensors_archive.write(kv.first, kv.second, /*is_buffer=*/true);
    group_archive.write("group_tensors", tensors_archive);
    archive.write("param_groups/" + std::to_string(i), group_archive);
    for (const auto& p : g.params()) {
      const auto it = state_.find(p.unsafeGetTensorImpl());
      const auto* s = it == state_.end() ? nullptr : dynamic_cast<const FusedParamState*>(it->second.get());
      if (s != nullptr && !s->defined_tensors().empty()) {
        torch::serialize::OutputArchive param_archive(archive.compilation_unit());
        s->serialize(param_archive);
        state_archive.write(std::to_string(index), param_archive);
      }
      ++index;
    }
  }
  archive.write("state", state_archive);
}

at::Tensor FusedOptimizer::checked_state_tensor(const std::string& where, const std::string& key,
                                                const at::Tensor& value, const at::Tensor& param,
                                                const FusedOptions& options) const {
  // Default rule: every state tensor of the op is float32.
  TORCH_CHECK_TYPE(value.scalar_type() == at::kFloat, where, " must be float32, got ", value.scalar_type());
  return value;
}

at::Tensor FusedOptimizer::checked_group_tensor(const std::string& where, const std::string& key,
                                                const at::Tensor& value,
                                                const torch::optim::OptimizerParamGroup& group) const {
  TORCH_CHECK_VALUE(false, where, " is not a group tensor ", name_, " knows");
  return value;
}

void FusedOptimizer::load(torch::serialize::InputArchive& archive) {
  using namespace mixprec::detail::api;
  const std::string where = name_ + ".load";
  c10::IValue format;
  TORCH_CHECK_VALUE(archive.try_read("mixprec_format", format) && format.isString() &&
                        format.toStringRef() == kFormat,
                    where, ": not a mixprec optimizer checkpoint of format ", kFormat,
                    " (torch::optim checkpoints do not load into mixprec optimizers)");
  const std::string saved_name = read_string(archive, "optimizer", where);
  TORCH_CHECK_VALUE(saved_name == name_, where, ": the checkpoint is of ", saved_name);
  const int64_t n_groups = read_int(archive, "param_groups/size", where);
  TORCH_CHECK_VALUE(n_groups == static_cast<int64_t>(param_groups_.size()), where, ": the checkpoint has ",
                    detail::num(n_groups), " param groups, this optimizer has ", detail::num(param_groups_.size()));

  // Everything is read and checked into these first; the optimizer changes only at the end.
  std::vector<std::unique_ptr<FusedOptions>> new_options;
  std::vector<std::map<std::string, at::Tensor>> new_group_tensors(param_groups_.size());
  std::vector<std::pair<size_t, at::Tensor>> param_at;  // global index -> (group, param)
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto& g = param_groups_[i];
    const std::string gw = group_where(where, i);
    torch::serialize::InputArchive group_archive;
    TORCH_CHECK_VALUE(archive.try_read("param_groups/" + std::to_string(i), group_archive), gw,
                      " is missing from the checkpoint");
    const int64_t n_params = read_int(group_archive, "params/size", gw);
    TORCH_CHECK_VALUE(n_params == static_cast<int64_t>(g.params().size()), gw, " has ",
                      detail::num(n_params), " params in the checkpoint but ", detail::num(g.params().size()), " here");
    for (const auto& p : g.params()) param_at.emplace_back(i, p);

    torch::serialize::InputArchive options_archive;
    TORCH_CHECK_VALUE(group_archive.try_read("options", options_archive), gw, " has no options in the checkpoint");
    std::unique_ptr<FusedOptions> o = make_options();
    try {
      o->serialize(options_archive);
    } catch (const c10::Error& e) {
      TORCH_CHECK_VALUE(false, gw, " options: ", e.msg());
    }
    o->check(gw + " options");

    torch::serialize::InputArchive tensors_archive;
    if (group_archive.try_read("group_tensors", tensors_archive)) {
      const at::Device device = g.params().empty() ? at::Device(at::kCPU) : g.params()[0].device();
      for (const std::string& key : tensors_archive.keys()) {
        at::Tensor t;
        const std::string tw = gw + "['" + key + "']";
        TORCH_CHECK_VALUE(tensors_archive.try_read(key, t, /*is_buffer=*/true) && t.defined(), tw,
                          " is not a tensor");
        if (key == "step") {
          TORCH_CHECK_VALUE(t.numel() == 1 && !t.is_complex(), tw,
                            " must hold one number, got shape ", detail::shape(t.sizes()));
          t = t.to(device, at::kFloat).reshape({1}).clone();
        } else {
          t = checked_group_tensor(tw, key, t, g).to(device);
        }
        new_group_tensors[i][key] = t;
      }
    }
    new_options.push_back(std::move(o));
  }

  decltype(state_) new_state;
  torch::serialize::InputArchive state_archive;
  if (archive.try_read("state", state_archive)) {
    for (const std::string& key : state_archive.keys()) {
      char* end = nullptr;
      const long long k = std::strtoll(key.c_str(), &end, 10);
      TORCH_CHECK_VALUE(!key.empty() && *end == '\0' && k >= 0 && k < static_cast<long long>(param_at.size()), where,
                        ": state for unknown parameter '", key, "' (the optimizer has ",
                        detail::num(param_at.size()), " params)");
      const size_t group = param_at[k].first;
      const at::Tensor& p = param_at[k].second;
      const FusedOptions& o = *new_options[group];
      torch::serialize::InputArchive param_archive;
      TORCH_CHECK_VALUE(state_archive.try_read(key, param_archive), where, ": state[", detail::num(k),
                        "] is not a state record");
      std::unique_ptr<FusedParamState> s = make_state();
      std::set<std::string> known;
      for (const auto& slot : s->slots()) known.insert(slot.first);
      for (const std::string& pk : param_archive.keys())
        TORCH_CHECK_VALUE(known.count(pk) != 0, where, ": state[", detail::num(k), "]['", pk,
                          "'] is not state ", name_, " knows");
      s->serialize(param_archive);
      bool any = false;
      for (const auto& slot : s->slots()) {
        at::Tensor& t = *slot.second;
        if (!t.defined()) continue;
        any = true;
        const std::string sw = where + ": state[" + std::to_string(k) + "]['" + slot.first + "']";
        TORCH_CHECK_TYPE(t.is_floating_point(), sw, " must be a floating-point tensor, got ", t.scalar_type());
        TORCH_CHECK_VALUE(t.sizes() == p.sizes(), sw, " has shape ", detail::shape(t.sizes()),
                          " but the parameter has ", detail::shape(p.sizes()));
        if (std::string(slot.first) == "master_param") {
          TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, sw, " must be float32, got ", t.scalar_type());
        } else {
          t = checked_state_tensor(sw, slot.first, t, p, o);
        }
        t = t.to(p.device()).contiguous();
      }
      TORCH_CHECK_VALUE(!any || !o.uses_master_weights() || p.scalar_type() == at::kFloat ||
                            s->master_param().defined(),
                        where, ": state[", detail::num(k),
                        "] has no 'master_param' but master weights are on and the parameter is ", p.scalar_type());
      if (any) new_state[p.unsafeGetTensorImpl()] = std::move(s);
    }
  }

  for (size_t i = 0; i < param_groups_.size(); ++i) param_groups_[i].set_options(std::move(new_options[i]));
  state_ = std::move(new_state);
  group_tensors_ = std::move(new_group_tensors);
}

}  // namespace mixprec::optim
