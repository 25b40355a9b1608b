// Checkpoints and copies of mixprec's C++ fused optimizers (include/mixprec/optim/fused_optimizer.h):
// save(), load() (everything validated before anything is written) and clone().
#include <mixprec/optim/fused_optimizer.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <set>
#include <utility>

#include "api/api_util.h"
#include "ops/front_rules.h"

namespace mixprec::optim {

using detail::api::group_where;

namespace {
// The checkpoint layout's name and version, checked on load.
constexpr const char* kFormat = "mixprec.optim.v1";
}  // namespace

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
  MIXPREC_CHECK_TYPE(value.scalar_type() == at::kFloat, where, " must be float32, got ", value.scalar_type());
  return value;
}

at::Tensor FusedOptimizer::checked_slot(const std::string& where, const std::string& key, const at::Tensor& value,
                                        const at::Tensor& param, const FusedOptions& options) const {
  // A master may be an int16 remainder of a bf16 param (master_remainder); the op steps either.
  if (checks_own_slot(key, value)) return checked_state_tensor(where, key, value, param, options);
  const bool remainder = key == "master_param" && value.scalar_type() == at::kShort;
  MIXPREC_CHECK_TYPE(value.is_floating_point() || remainder, where, " must be a floating-point tensor, got ",
                     value.scalar_type());
  MIXPREC_CHECK_VALUE(value.sizes() == param.sizes(), where, " has shape ", detail::shape(value.sizes()),
                      " but the parameter has ", detail::shape(param.sizes()));
  if (remainder) {  // the rule and text of python's load_state_dict too (ops/front_rules.h)
    detail::check_master_remainder(param, "", "master_remainder", where, /*loaded=*/true);
    return value;
  }
  if (key == "master_param") {
    MIXPREC_CHECK_TYPE(value.scalar_type() == at::kFloat, where, " must be float32, got ", value.scalar_type());
    return value;
  }
  return checked_state_tensor(where, key, value, param, options);
}

at::Tensor FusedOptimizer::checked_group_tensor(const std::string& where, const std::string& key,
                                                const at::Tensor& value,
                                                const torch::optim::OptimizerParamGroup& group) const {
  MIXPREC_CHECK_VALUE(false, where, " is not a group tensor ", name_, " knows");
  return value;
}

void FusedOptimizer::load(torch::serialize::InputArchive& archive) {
  using namespace mixprec::detail::api;
  const std::string where = name_ + ".load";
  c10::IValue format;
  MIXPREC_CHECK_VALUE(
      archive.try_read("mixprec_format", format) && format.isString() && format.toStringRef() == kFormat, where,
      ": not a mixprec optimizer checkpoint of format ", kFormat,
      " (torch::optim checkpoints do not load into mixprec optimizers)");
  const std::string saved_name = read_string(archive, "optimizer", where);
  MIXPREC_CHECK_VALUE(saved_name == name_, where, ": the checkpoint is of ", saved_name);
  const int64_t n_groups = read_int(archive, "param_groups/size", where);
  MIXPREC_CHECK_VALUE(n_groups == static_cast<int64_t>(param_groups_.size()), where, ": the checkpoint has ",
                      detail::num(n_groups), " param groups, this optimizer has ", detail::num(param_groups_.size()));

  // Everything is read and checked into these first; the optimizer changes only at the end.
  std::vector<std::unique_ptr<FusedOptions>> new_options;
  std::vector<std::map<std::string, at::Tensor>> new_group_tensors(param_groups_.size());
  std::vector<std::pair<size_t, at::Tensor>> param_at;  // global index -> (group, param)
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto& g = param_groups_[i];
    const std::string gw = group_where(where, i);
    torch::serialize::InputArchive group_archive;
    MIXPREC_CHECK_VALUE(archive.try_read("param_groups/" + std::to_string(i), group_archive), gw,
                        " is missing from the checkpoint");
    const int64_t n_params = read_int(group_archive, "params/size", gw);
    MIXPREC_CHECK_VALUE(n_params == static_cast<int64_t>(g.params().size()), gw, " has ", detail::num(n_params),
                        " params in the checkpoint but ", detail::num(g.params().size()), " here");
    for (const auto& p : g.params()) param_at.emplace_back(i, p);

    torch::serialize::InputArchive options_archive;
    MIXPREC_CHECK_VALUE(group_archive.try_read("options", options_archive), gw, " has no options in the checkpoint");
    std::unique_ptr<FusedOptions> o = make_options();
    try {
      o->serialize(options_archive);
    } catch (const c10::Error& e) {
      MIXPREC_CHECK_VALUE(false, gw, " options: ", e.msg());
    }
    o->check(gw + " options");

    torch::serialize::InputArchive tensors_archive;
    if (group_archive.try_read("group_tensors", tensors_archive)) {
      const at::Device device = g.params().empty() ? at::Device(at::kCPU) : g.params()[0].device();
      for (const std::string& key : tensors_archive.keys()) {
        at::Tensor t;
        const std::string tw = gw + "['" + key + "']";
        MIXPREC_CHECK_VALUE(tensors_archive.try_read(key, t, /*is_buffer=*/true) && t.defined(), tw,
                            " is not a tensor");
        if (key == "step") {
          MIXPREC_CHECK_VALUE(t.numel() == 1 && !t.is_complex(), tw, " must hold one number, got shape ",
                              detail::shape(t.sizes()));
          // A checkpoint's count is read on the host anyway (it comes from a file): a NaN, inf or
          // negative count would feed bias corrections of NaN or of the wrong sign.
          const double count = t.to(at::kCPU, at::kDouble).item<double>();
          MIXPREC_CHECK_VALUE(std::isfinite(count) && count >= 0, tw, " is ", detail::num(count),
                              "; expected a finite step count >= 0");
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
      MIXPREC_CHECK_VALUE(!key.empty() && *end == '\0' && k >= 0 && k < static_cast<long long>(param_at.size()), where,
                          ": state for unknown parameter '", key, "' (the optimizer has ", detail::num(param_at.size()),
                          " params)");
      const size_t group = param_at[k].first;
      const at::Tensor& p = param_at[k].second;
      const FusedOptions& o = *new_options[group];
      torch::serialize::InputArchive param_archive;
      MIXPREC_CHECK_VALUE(state_archive.try_read(key, param_archive), where, ": state[", detail::num(k),
                          "] is not a state record");
      std::unique_ptr<FusedParamState> s = make_state();
      std::set<std::string> known;
      for (const auto& slot : s->slots()) known.insert(slot.first);
      for (const std::string& pk : param_archive.keys())
        MIXPREC_CHECK_VALUE(known.count(pk) != 0, where, ": state[", detail::num(k), "]['", pk, "'] is not state ",
                            name_, " knows");
      s->serialize(param_archive);
      bool any = false;
      for (const auto& slot : s->slots()) {
        at::Tensor& t = *slot.second;
        if (!t.defined()) continue;
        any = true;
        const std::string sw = where + ": state[" + std::to_string(k) + "]['" + slot.first + "']";
        const at::Tensor checked = checked_slot(sw, slot.first, t, p, o);
        // Param-shaped state in the param's layout; other shapes (per-block scales) contiguous.
        t = checked.sizes() == p.sizes() ? copy_in_layout_of(checked, p) : checked.to(p.device()).contiguous().clone();
      }
      MIXPREC_CHECK_VALUE(
          !any || !o.uses_master_weights() || p.scalar_type() == at::kFloat || s->master_param().defined(), where,
          ": state[", detail::num(k), "] has no 'master_param' but master weights are on and the parameter is ",
          p.scalar_type());
      if (any) new_state[p.unsafeGetTensorImpl()] = std::move(s);
    }
  }

  for (size_t i = 0; i < param_groups_.size(); ++i) param_groups_[i].set_options(std::move(new_options[i]));
  state_ = std::move(new_state);
  group_tensors_ = std::move(new_group_tensors);
  forget_plans();  // its state objects are gone
}

// ---- copies -------------------------------------------------------------------------------------
std::unique_ptr<FusedOptimizer> FusedOptimizer::clone_base(const std::vector<at::Tensor>& params) const {
  const std::string where = name_ + ".clone";
  sync_group_slots();
  size_t total = 0;
  for (const auto& g : param_groups_) total += g.params().size();
  MIXPREC_CHECK_VALUE(params.size() == total, where, ": got ", detail::num(params.size()), " params; expected ",
                      detail::num(total), " (one per parameter of this optimizer, in group order)");
  // Checked first; the copy is built only from valid input and this optimizer is never written.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  size_t k = 0;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    std::vector<at::Tensor> ps;
    for (const auto& p : param_groups_[i].params()) {
      const at::Tensor& q = params[k];
      const std::string pw = where + ": params[" + std::to_string(k++) + "]";
      MIXPREC_CHECK_VALUE(q.defined(), pw, " is undefined; expected a tensor like ", detail::shape(p.sizes()));
      MIXPREC_CHECK_TYPE(q.scalar_type() == p.scalar_type(), pw, " has dtype ", q.scalar_type(), "; expected ",
                         p.scalar_type(), ", the dtype of the parameter it replaces");
      MIXPREC_CHECK_VALUE(q.sizes() == p.sizes(), pw, " has shape ", detail::shape(q.sizes()), "; expected ",
                          detail::shape(p.sizes()), ", the shape of the parameter it replaces");
      ps.push_back(q);
    }
    groups.emplace_back(std::move(ps), options_of(i).clone());
  }
  std::unique_ptr<FusedOptimizer> out = make_empty(groups);
  // The constructor completes group options from the defaults; the copy keeps them exactly.
  for (size_t i = 0; i < param_groups_.size(); ++i) out->param_groups_[i].set_options(options_of(i).clone());
  const auto copy_to = [](const at::Tensor& t, const at::Device& device) {
    return t.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
  };
  out->sync_group_slots();
  k = 0;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto& new_params = out->param_groups_[i].params();
    for (const auto& kv : group_tensors_[i])
      if (kv.second.defined())
        out->group_tensors_[i][kv.first] =
            copy_to(kv.second, new_params.empty() ? kv.second.device() : new_params[0].device());
    for (const auto& p : param_groups_[i].params()) {
      const at::Tensor& q = params[k++];
      const auto it = state_.find(p.unsafeGetTensorImpl());
      auto* s = it == state_.end() ? nullptr : dynamic_cast<FusedParamState*>(it->second.get());
      if (s == nullptr) continue;
      std::unique_ptr<FusedParamState> c = out->make_state();
      const auto from = s->slots();  // same class, so the same slots in the same order
      const auto to = c->slots();
      for (size_t j = 0; j < from.size(); ++j)
        if (from[j].second->defined()) *to[j].second = detail::api::copy_in_layout_of(*from[j].second, q);
      out->state_[q.unsafeGetTensorImpl()] = std::move(c);
    }
  }
  return out;
}

}  // namespace mixprec::optim
