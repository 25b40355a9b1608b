// FusedOptimizer::step (include/mixprec/optim/fused_optimizer.h): every group checked before any
// steps, with each group's lists (params, grads, masters, state) built once and reused while
// nothing they were built from changes, so a step's host work is comparisons, not rebuilding.
#include <mixprec/optim/fused_optimizer.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <typeinfo>
#include <utility>

#include "api/api_util.h"
#include "ops/front_rules.h"

namespace mixprec::optim {

using detail::api::group_where;
using detail::api::param_where;
using detail::api::same_layout;
using detail::api::state_where;

namespace {

// Everything a check of one tensor read: identity, storage, dtype, device, shape and strides. A
// tensor matching its key passes every check it passed when the key was taken; so does another
// tensor reusing a freed one's address with all of these equal (the checks read nothing else).
struct TensorKey {
  const c10::TensorImpl* impl = nullptr;
  bool dense = false;  // undefined or strided: a sparse tensor (a refused grad) never matches
  const void* data = nullptr;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device{c10::kCPU};
  c10::SmallVector<int64_t, 4> sizes, strides;

  TensorKey() = default;
  explicit TensorKey(const at::Tensor& t) : impl(t.unsafeGetTensorImpl()) {
    if (t.defined() && t.layout() != at::kStrided) return;
    dense = true;
    if (!t.defined()) return;
    data = t.const_data_ptr();
    dtype = t.scalar_type();
    device = t.device();
    sizes.assign(t.sizes().begin(), t.sizes().end());
    strides.assign(t.strides().begin(), t.strides().end());
  }

  bool matches(const at::Tensor& t) const {
    if (!dense || t.unsafeGetTensorImpl() != impl) return false;
    if (!t.defined()) return true;  // the undefined tensor's impl is one singleton
    return t.const_data_ptr() == data && t.scalar_type() == dtype && t.device() == device &&
           t.sizes() == c10::IntArrayRef(sizes) && t.strides() == c10::IntArrayRef(strides);
  }
};

// A defined master in the form its group does not keep: an int16 remainder in a group of fp32
// masters, or an fp32 master of a bf16 param in a remainder group (fp16 params have no remainder
// form; an fp32 master of an fp32 param is its own form).
bool master_in_other_form(const at::Tensor& p, const at::Tensor& master, const FusedOptions& options) {
  if (!master.defined() || !options.uses_master_weights()) return false;
  if (options.uses_master_remainder()) return master.scalar_type() == at::kFloat && p.scalar_type() == at::kBFloat16;
  return master.scalar_type() == at::kShort;
}

}  // namespace

// Per group: its lists and the keys of everything they and its checks were built from.
struct FusedOptimizer::StepPlans {
  struct Group {
    bool built = false;
    std::unique_ptr<torch::optim::OptimizerOptions> options;  // a copy; lr may differ
    const FusedOptions* planned = nullptr;                    // *options as the family's class
    std::vector<const c10::TensorImpl*> members;              // every param of the group, in order
    std::vector<size_t> with_grad;                            // positions of the params with a grad
    struct Entry {
      TensorKey param, grad;
      const torch::optim::OptimizerParamState* state;  // the object the slots point into
      const std::type_info* state_type;
      std::vector<at::Tensor*> slots;
      std::vector<TensorKey> slot_keys;
    };
    std::vector<Entry> entries;
    GroupLists lists;
    // master_weights off, yet a param with a grad holds a master: its step moves the param alone,
    // so the master goes after it (end of step()).
    bool stale_masters = false;
    // A master in the form the group does not keep (a checkpoint's fp32 master in a remainder
    // group, or its remainder in an fp32-master group): the op steps either form, and after the
    // step it takes the group's form (end of step()), as the Python front's settle() does.
    bool other_form_masters = false;
    // The group's op took these lists (and every grad since) at lr `op_lr`: while they hold, its
    // check twin would pass them again (what it reads, the keys above hold), so step() skips it.
    bool op_took = false;
    double op_lr = 0;
  };
  std::vector<Group> groups;
  // What this step's rebuilt lists made (state objects, and tensors of existing states: masters
  // for a group switched to master_weights, or for a param cast to fp16/bf16 after steps): taken
  // back if the step is refused before its first write, as the Python front does. Empty while
  // every group's lists hold.
  std::vector<void*> made_states;
  std::vector<at::Tensor*> made_tensors;
};

void FusedOptimizer::DeletePlans::operator()(StepPlans* plans) const { delete plans; }

void FusedOptimizer::forget_plans() { plans_.reset(); }

const std::vector<at::Tensor>& FusedOptimizer::GroupLists::slot(const char* key) const {
  for (size_t i = 0; i < keys.size(); ++i)
    if (std::strcmp(keys[i], key) == 0) return slots[i];
  MIXPREC_CHECK(false, "mixprec::optim: no state slot '", key, "'");
  return slots[0];  // unreachable: the check above throws
}

// ---- checks ----------------------------------------------------------------------------------
void FusedOptimizer::check_grad(size_t index, size_t j, const at::Tensor& p) const {
  const auto op_dtype = [](at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; };
  const at::Tensor& g = p.grad();
  MIXPREC_CHECK(!g.is_sparse(), name_, " does not support sparse gradients (param group ", detail::num(index), ")");
  MIXPREC_CHECK_TYPE(op_dtype(g.scalar_type()), param_where(name_, index, j), ".grad has dtype ", g.scalar_type(),
                     "; expected float32, float16 or bfloat16");
  MIXPREC_CHECK_VALUE(g.device() == p.device(), param_where(name_, index, j), ".grad is on ", g.device().str(),
                      "; expected the parameter's ", p.device().str());
  MIXPREC_CHECK_VALUE(g.sizes() == p.sizes(), param_where(name_, index, j), ".grad has shape ",
                      detail::shape(g.sizes()), "; expected the parameter's ", detail::shape(p.sizes()));
  MIXPREC_CHECK_VALUE(same_layout(g, p), param_where(name_, index, j), ".grad has strides ", detail::shape(g.strides()),
                      "; expected the parameter's layout, strides ", detail::shape(p.strides()),
                      " (as autograd lays out gradients)");
}

void FusedOptimizer::check_step_inputs(size_t index, const std::vector<at::Tensor>& params,
                                       const FusedOptions& options) const {
  // What the op would refuse, checked for every group before any state is made, in the front's
  // words (the group and the param's place in it); what only the op checks (memory shared between
  // its tensors) its check twin refuses in step(), still before any group steps. Messages are
  // built only on failure.
  const auto op_dtype = [](at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; };
  for (size_t j = 0; j < params.size(); ++j) {
    const at::Tensor& p = params[j];
    MIXPREC_CHECK_TYPE(op_dtype(p.scalar_type()), param_where(name_, index, j), " has dtype ", p.scalar_type(),
                       "; expected float32, float16 or bfloat16");
    MIXPREC_CHECK_VALUE(p.is_non_overlapping_and_dense(), param_where(name_, index, j), " has strides ",
                        detail::shape(p.strides()), " for shape ", detail::shape(p.sizes()),
                        ", which skip or repeat memory; expected a dense parameter (contiguous, channels_last or "
                        "any permutation of dimensions)");
    check_grad(index, j, p);
    const auto it = state_.find(p.unsafeGetTensorImpl());
    auto* s = it == state_.end() ? nullptr : dynamic_cast<FusedParamState*>(it->second.get());
    if (s == nullptr) continue;
    for (const auto& slot : s->slots()) {
      const at::Tensor& t = *slot.second;
      if (!t.defined()) continue;
      // float32 of the param's shape passes every family's rule; anything else gets the full check
      // (the family's own rule, e.g. bfloat16 Adam moments) that load() applies.
      if (t.scalar_type() != at::kFloat || t.sizes() != p.sizes()) {
        checked_slot(state_where(name_, index, j, slot.first), slot.first, t, p, options);
      }
      MIXPREC_CHECK_VALUE(t.device() == p.device(), state_where(name_, index, j, slot.first), " is on ",
                          t.device().str(), "; expected the parameter's ", p.device().str());
      MIXPREC_CHECK_VALUE(t.sizes() != p.sizes() || same_layout(t, p), state_where(name_, index, j, slot.first),
                          " has strides ", detail::shape(t.strides()), "; expected the parameter's layout, strides ",
                          detail::shape(p.strides()));
    }
  }
  // After the per-param checks, as the Python front orders them; the rule and its text are the
  // ones python's master_weights="remainder" gets (ops/front_rules.h).
  if (options.uses_master_weights() && options.uses_master_remainder())
    detail::check_master_remainder(params, name_, "master_remainder", group_where("", index).substr(2) + ": params[{}]",
                                   /*loaded=*/false);
}

// ---- the lists -------------------------------------------------------------------------------
bool FusedOptimizer::plan_holds(size_t index, const FusedOptions& options) {
  StepPlans::Group& plan = plans_->groups[index];
  plan.lists.grads.clear();
  if (!plan.built || !options.same_but_lr(*plan.planned)) return false;
  const auto& params = param_groups_[index].params();
  if (params.size() != plan.members.size()) return false;
  size_t k = 0;
  for (size_t j = 0; j < params.size(); ++j) {
    const at::Tensor& p = params[j];
    if (p.unsafeGetTensorImpl() != plan.members[j]) return false;
    const at::Tensor& g = p.grad();
    const bool planned_grad = k < plan.with_grad.size() && plan.with_grad[k] == j;
    if (g.defined() != planned_grad) return false;
    if (!planned_grad) continue;
    StepPlans::Group::Entry& e = plan.entries[k];
    if (!e.param.matches(p)) return false;
    // The state object is looked up each step: the map is public (Optimizer::state()), so an
    // entry may have been replaced, and the slot pointers are only valid into the planned one.
    const auto it = state_.find(p.unsafeGetTensorImpl());
    if (it == state_.end() || it->second.get() != e.state || typeid(*it->second) != *e.state_type) return false;
    for (size_t s = 0; s < e.slots.size(); ++s)
      if (!e.slot_keys[s].matches(*e.slots[s])) return false;
    if (!e.grad.matches(g)) {  // a new grad each step after zero_grad(set_to_none): its checks only
      check_grad(index, k, p);
      e.grad = TensorKey(g);
      plan.op_took = false;  // and the op's (a grad may share memory with what the op writes)
    }
    plan.lists.grads.push_back(g);
    ++k;
  }
  return k == plan.with_grad.size();
}

void FusedOptimizer::build_plan(size_t index, const FusedOptions& options, std::vector<at::Tensor> with_grads) {
  StepPlans::Group& plan = plans_->groups[index];
  plan = StepPlans::Group{};
  for (const auto& p : with_grads) {
    const auto it = state_.find(p.unsafeGetTensorImpl());
    if (it == state_.end()) {
      plans_->made_states.push_back(p.unsafeGetTensorImpl());
      ensure_state(p, options);
      continue;
    }
    c10::SmallVector<at::Tensor*, 8> undefined;
    for (const auto& slot : state_of(p).slots())
      if (!slot.second->defined()) undefined.push_back(slot.second);
    ensure_state(p, options);
    for (at::Tensor* t : undefined)
      if (t->defined()) plans_->made_tensors.push_back(t);
  }
  const auto& params = param_groups_[index].params();
  for (size_t j = 0, k = 0; j < params.size(); ++j) {
    plan.members.push_back(params[j].unsafeGetTensorImpl());
    if (k < with_grads.size() && params[j].unsafeGetTensorImpl() == with_grads[k].unsafeGetTensorImpl()) {
      plan.with_grad.push_back(j);
      ++k;
    }
  }
  GroupLists& l = plan.lists;
  l.masters = masters(with_grads, options);
  for (const auto& p : with_grads) {
    FusedParamState& s = state_of(p);
    plan.stale_masters = plan.stale_masters || (!options.uses_master_weights() && s.master_param().defined());
    plan.other_form_masters = plan.other_form_masters || master_in_other_form(p, s.master_param(), options);
    const auto slots = s.slots();
    if (l.keys.empty()) {
      for (const auto& slot : slots) l.keys.push_back(slot.first);
      l.slots.resize(slots.size());
    }
    StepPlans::Group::Entry e{TensorKey(p), TensorKey(p.grad()), &s, &typeid(s), {}, {}};
    for (size_t i = 0; i < slots.size(); ++i) {
      e.slots.push_back(slots[i].second);
      e.slot_keys.emplace_back(*slots[i].second);
      l.slots[i].push_back(*slots[i].second);
    }
    plan.entries.push_back(std::move(e));
    l.grads.push_back(p.grad());
  }
  if (l.keys.empty()) {  // no param with a grad: the slot lists are there, empty
    for (const auto& slot : make_state()->slots()) l.keys.push_back(slot.first);
    l.slots.resize(l.keys.size());
  }
  l.params = std::move(with_grads);
  plan.options = options.clone();
  plan.planned = cast_options(*plan.options);
  plan.built = true;
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
  if (!plans_) plans_.reset(new StepPlans());
  std::vector<StepPlans::Group>& plans = plans_->groups;
  plans.resize(param_groups_.size());
  // The lists hold this step's grads only while it runs: zero_grad(set_to_none) frees them after.
  struct ReleaseGrads {
    std::vector<StepPlans::Group>& plans;
    ~ReleaseGrads() {
      for (auto& plan : plans) plan.lists.grads.clear();
    }
  } release_grads{plans};

  // Every group is checked before any op runs: a bad group leaves all of them as they were.
  // Options are checked every step (an LR scheduler may have set any lr); the tensors only where
  // something changed since the group's lists were built.
  std::vector<const FusedOptions*> options(param_groups_.size());
  std::vector<std::pair<size_t, std::vector<at::Tensor>>> rebuild;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const FusedOptions& o = options_of(i);
    options[i] = &o;
    o.check(group_where(name_, i));
    if (plan_holds(i, o)) continue;
    plans[i].built = false;
    std::vector<at::Tensor> with_grads;
    for (const auto& p : param_groups_[i].params()) {
      if (!p.grad().defined()) continue;
      MIXPREC_CHECK(!p.grad().is_sparse(), name_, " does not support sparse gradients (param group ", detail::num(i),
                    ")");
      if (!with_grads.empty())
        MIXPREC_CHECK_VALUE(p.device() == with_grads[0].device(), group_where(name_, i), " mixes devices (",
                            with_grads[0].device(), " and ", p.device(),
                            "); put each device's params in its own group");
      with_grads.push_back(p);
    }
    check_step_inputs(i, with_grads, o);
    rebuild.emplace_back(i, std::move(with_grads));
  }

  // Until the first op returns nothing is written: every group but the first is validated by its
  // op's check twin (step_group with validate_only, the same calls its step makes; not while its
  // lists, grads and lr are those its op last took), and the first group's op checks all before
  // it writes. A refusal up to there takes back what this step made (state objects, masters,
  // step counts and other group tensors made or moved), so it changes nothing, whichever group
  // is refused and whether its front or only its op refuses it.
  plans_->made_states.clear();
  plans_->made_tensors.clear();
  struct Held {  // a group tensor before this step: step counts, NovoGrad's norms
    size_t group;
    const std::string* key;
    at::Tensor value;
  };
  c10::SmallVector<Held, 8> held;
  for (size_t i = 0; i < group_tensors_.size(); ++i)
    for (const auto& kv : group_tensors_[i]) held.push_back({i, &kv.first, kv.second});
  const auto take_back = [&] {
    for (at::Tensor* t : plans_->made_tensors) *t = at::Tensor();
    for (void* impl : plans_->made_states) state_.erase(impl);
    for (size_t i = 0; i < group_tensors_.size(); ++i) {
      auto& tensors = group_tensors_[i];
      for (auto it = tensors.begin(); it != tensors.end();) {
        const auto h =
            std::find_if(held.begin(), held.end(), [&](const Held& x) { return x.group == i && x.key == &it->first; });
        if (h == held.end()) {
          it = tensors.erase(it);
        } else {
          (it++)->second = h->value;
        }
      }
    }
    for (auto& plan : plans) plan.built = false;  // they point into what was taken back
  };
  struct EndStep {
    FusedOptimizer* self;
    ~EndStep() { self->end_step(); }
  } end_step_guard{this};
  c10::SmallVector<StepArgs, 4> args(param_groups_.size());
  size_t first = param_groups_.size();    // the first group with grads: stepped before the others
  const auto run_group = [&](size_t i) {  // its op: it checks before it writes
    step_group(i, plans[i].lists, *options[i], args[i]);
    plans[i].op_took = true;
    plans[i].op_lr = args[i].lr;
  };
  try {
    for (auto& r : rebuild) build_plan(r.first, *options[r.first], std::move(r.second));
    begin_step();
    for (size_t i = 0; i < param_groups_.size(); ++i) {
      const GroupLists& l = plans[i].lists;
      if (l.params.empty()) continue;
      const at::Device device = l.params[0].device();
      StepArgs& a = args[i];
      a.lr = options[i]->get_lr();
      a.step_tensor = step_tensor_for(i, device);
      const GradScaling s = scaling_on(device);
      a.grad_scale = s.grad_scale;
      a.found_inf = s.found_inf;
      if (first == param_groups_.size()) {
        first = i;
        continue;
      }
      if (plans[i].op_took && plans[i].op_lr == a.lr) continue;
      StepArgs check = a;
      check.validate_only = true;
      step_group(i, l, *options[i], check);
    }
    if (first < param_groups_.size()) run_group(first);
  } catch (...) {
    take_back();
    throw;
  }
  for (size_t i = first + 1; i < param_groups_.size(); ++i)
    if (!plans[i].lists.params.empty()) run_group(i);
  // A group stepped without masters moved its params alone: their masters are stale, and kept
  // they would bring the old weights back once master_weights is on again. Dropped, the next
  // master step makes them anew from the params (ensure_state); the lists held them, so rebuilt.
  for (size_t i = 0; i < plans.size(); ++i) {
    if (!plans[i].stale_masters) continue;
    for (const auto& p : plans[i].lists.params) state_of(p).master_param(at::Tensor());
    plans[i].built = false;
  }
  // Masters stepped in the other form take their group's: split into weight and remainder, or
  // rebuilt into an fp32 master with the weight rounded from it to nearest even (what an
  // fp32-master step writes; the remainder step wrote it with ties toward zero).
  for (size_t i = 0; i < plans.size(); ++i) {
    if (!plans[i].other_form_masters) continue;
    const FusedOptions& o = *options[i];
    for (const auto& p : plans[i].lists.params) {
      FusedParamState& s = state_of(p);
      if (!master_in_other_form(p, s.master_param(), o)) continue;
      if (s.master_param().scalar_type() == at::kShort) {
        const at::Tensor master = detail::master_rebuild(p.detach(), s.master_param());
        p.detach().copy_(master);
        s.master_param(master);
      } else {
        auto [weight, remainder] = detail::master_split(s.master_param());
        p.detach().copy_(weight);
        s.master_param(remainder);
      }
    }
    plans[i].built = false;
  }
  return loss;
}

}  // namespace mixprec::optim
