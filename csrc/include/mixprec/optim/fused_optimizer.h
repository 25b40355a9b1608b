// The base of mixprec's fused optimizers for LibTorch: a torch::optim::Optimizer whose step is one
// mixprec op per param group, with device step counts, fp32 master weights, in-kernel loss scaling
// and validated checkpoints; the C++ twin of python/mixprec/optimizers/_base.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mixprec/export.h>
#include <mixprec/ops.h>

namespace mixprec::optim {

// Per-parameter state of a fused optimizer: the fp32 master (with master weights, for non-fp32
// params) and the family's tensors. slots() lists them under the Python front's state_dict keys.
class MIXPREC_API FusedParamState : public torch::optim::OptimizerParamState {
 public:
  TORCH_ARG(at::Tensor, master_param);

 public:
  using Slot = std::pair<const char*, at::Tensor*>;
  // Every state tensor with its checkpoint key, master_param first.
  virtual std::vector<Slot> slots() = 0;
  // The defined state tensors, by key.
  std::vector<std::pair<std::string, at::Tensor>> defined_tensors() const;
  // Writes the defined tensors; reads every known key that is present (unknown keys are ignored
  // here: FusedOptimizer::load checks them).
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

template <class Derived> class MIXPREC_API FusedCloneableParamState : public FusedParamState {
 public:
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override {
    return std::make_unique<Derived>(static_cast<const Derived&>(*this));
  }
};

// A family's state class `Name` from the X-macro list TENSORS of its state tensors, X(key): an
// accessor pair each (s.exp_avg(), s.exp_avg(t)), and slots() under their own names.
#define MIXPREC_STATE_TENSOR(key) TORCH_ARG(at::Tensor, key);
#define MIXPREC_STATE_SLOT(key) {#key, &key##_},
#define MIXPREC_FUSED_PARAM_STATE(Name, TENSORS)                                                                    \
  struct MIXPREC_API Name : public FusedCloneableParamState<Name> {                                                 \
    TENSORS(MIXPREC_STATE_TENSOR)                                                                                   \
                                                                                                                    \
   public:                                                                                                          \
    std::vector<Slot> slots() override { return {{"master_param", &master_param()}, TENSORS(MIXPREC_STATE_SLOT)}; } \
  }

// What the base needs from every family's options class (FusedAdamOptions, ...): the learning
// rate (get_lr/set_lr, so torch::optim's LR schedulers work), master weights, validation and
// serialization. Options are per param group, as in torch::optim.
class MIXPREC_API FusedOptions : public torch::optim::OptimizerOptions {
 public:
  virtual bool uses_master_weights() const = 0;
  virtual void set_master_weights(bool on) = 0;
  // With master weights: bf16 params keep only the low 16 bits of their fp32 masters (an int16
  // remainder in the master_param slot; docs/optimizers.md). False for options without the field.
  virtual bool uses_master_remainder() const { return false; }
  // Throws a ValueError naming `where` and the field when a hyper-parameter is out of range.
  virtual void check(const std::string& where) const = 0;
  // A param group's options inherit every field still at its constructor default (`fresh`) from
  // the optimizer's `defaults`: torch::optim's rule for its own optimizers from torch 2.10 on
  // (and Python's, where a group names only what differs). `defaults` and `fresh` are of this class.
  virtual void inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh) = 0;
  // Whether every field but lr equals `other`'s (of this class): step() rebuilds a group's lists
  // and checks when its options change, and not when an LR scheduler changes only lr.
  virtual bool same_but_lr(const FusedOptions& other) const = 0;
};

// The one-element float32 device scalars a GradScaler hands to a fused step.
struct GradScaling {
  std::optional<at::Tensor> grad_scale;  // grads are divided by it inside the kernel
  std::optional<at::Tensor> found_inf;   // non-zero: the step changes nothing, on the device
};

class MIXPREC_API FusedOptimizer : public torch::optim::Optimizer {
 public:
  // Runs `closure` (with grad enabled) if given, then one fused op per param group over the
  // params that have a gradient. Nothing here waits on the device. Every group's options, params
  // (any dense layout: contiguous, channels_last, any permutation of dimensions), grads (dense,
  // float32/16/bf16, the param's shape, layout and device) and state tensors are checked before
  // any group steps: a refused step changes no param, state or step count.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // Adds a group; fields of its options left at their constructor defaults come from the
  // optimizer's defaults (see FusedOptions::inherit_unset). Hides torch's non-virtual
  // add_param_group, which, called through an Optimizer&, would give the group the defaults only.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  // Loss-scaling hand-off (what torch.amp.GradScaler does with `optimizer.grad_scale` and
  // `optimizer.found_inf` for fused optimizers): used by every following step() until changed.
  // mixprec::amp::GradScaler sets and clears it around its step().
  void set_grad_scaling(GradScaling scaling) { scaling_ = std::move(scaling); }
  const GradScaling& grad_scaling() const noexcept { return scaling_; }

  // Checkpoints: options, per-parameter state (masters included) and step counts of every group.
  // load() validates all of it against this optimizer's params before changing anything.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // An independent copy bound to `params` (one per parameter of this optimizer, in group order,
  // each of the dtype and shape of the one it replaces; any device): the same groups and options,
  // deep copies of every state tensor (moments, masters) and step count, moved to the new
  // params' devices and laid out as the new params are. torch::optim has no clone; this is what copying an optimizer
  // means here. The loss-scaling hand-off (set_grad_scaling) is not copied. Each family's clone() returns its own type
  // (see MIXPREC_FUSED_OPTIMIZER_CLASS).
  std::unique_ptr<FusedOptimizer> clone_base(const std::vector<at::Tensor>& params) const;

  // "mixprec::optim::FusedAdam" etc., the prefix of every error message.
  const std::string& name() const noexcept { return name_; }

  // The group's step count: a one-element float32 tensor on the group's device, incremented by
  // the op unless the step is skipped (undefined before the group's first step).
  at::Tensor step_count_tensor(size_t group) const;
  // The same as a number (0 before the first step). Reads the device: synchronizes.
  int64_t step_count(size_t group) const;

  // Every parameter's fp32 master: the master when it has one, else the parameter itself.
  std::vector<at::Tensor> master_params() const;
  // Turns master weights on or off for the defaults and every group.
  void set_master_weights(bool on);
  // Seeds `param`'s master with `master` (float32, same shape): for callers that hold fp32
  // values more exact than the param's (mixprec::amp::initialize before it casts the model).
  void set_master(const at::Tensor& param, const at::Tensor& master);
  // Creates every missing state tensor now, as the first step would (moments, masters).
  void init_state();

 protected:
  FusedOptimizer(std::string name, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                 std::unique_ptr<FusedOptions> defaults);

  // ---- what each family implements ----
  // A new optimizer of the family over `groups` with this one's defaults (for clone_base).
  virtual std::unique_ptr<FusedOptimizer> make_empty(
      const std::vector<torch::optim::OptimizerParamGroup>& groups) const = 0;
  virtual std::unique_ptr<FusedParamState> make_state() const = 0;
  virtual std::unique_ptr<FusedOptions> make_options() const = 0;  // defaults, for load()
  virtual const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const = 0;
  // Creates the family's missing state tensors of `p` (the base makes the master).
  virtual void init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) = 0;
  // What step() hands a family for one group: the params that have a grad (all on one device),
  // their grads, their masters ([] without master weights) and one list per state slot, in
  // slots() order. Built once and reused while no tensor, member or option of the group changes.
  struct GroupLists {
    std::vector<at::Tensor> params, grads, masters;
    std::vector<const char*> keys;  // the slots' keys
    std::vector<std::vector<at::Tensor>> slots;
    const std::vector<at::Tensor>& slot(const char* key) const;
  };
  // Runs the op for group `index` over `lists`; the one place that builds the op's arguments, so
  // with args.validate_only it makes the same calls through the ops' check twins and must write
  // nothing (no state, group tensor or step count): step() runs it so for every group but the
  // first before any group steps (the first's op checks before it writes).
  virtual void step_group(size_t index, const GroupLists& lists, const FusedOptions& options, const StepArgs& args) = 0;
  // Around the group loop of step(): LAMB computes its global gradient norm here.
  virtual void begin_step() {}
  virtual void end_step() noexcept {}
  // Checks a loaded state tensor beyond shape (dtype rules of the family); may convert it.
  virtual at::Tensor checked_state_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                          const at::Tensor& param, const FusedOptions& options) const;
  // Whether slot `key` holding `value` is checked by checked_state_tensor alone, not shaped like
  // the param or not floating point (FusedAdam's 8-bit codes and their per-block scales).
  virtual bool checks_own_slot(const std::string& key, const at::Tensor& value) const { return false; }
  // Checks a loaded group tensor other than "step" (NovoGrad's exp_avg_sq); returns it converted.
  virtual at::Tensor checked_group_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                          const torch::optim::OptimizerParamGroup& group) const;

  // The checks load() and step() share for one state tensor of `param`: floating point, the
  // param's shape, float32 masters, the family's dtype rule; returns it as load() stores it.
  at::Tensor checked_slot(const std::string& where, const std::string& key, const at::Tensor& value,
                          const at::Tensor& param, const FusedOptions& options) const;

  // ---- helpers for families ----
  // A clone of a group's `given` options completed from the defaults and checked.
  std::unique_ptr<torch::optim::OptimizerOptions> completed_options(const torch::optim::OptimizerOptions& given,
                                                                    size_t group) const;
  // Completes every group's options from the defaults and checks them all: each family's
  // constructor calls it last (virtual calls work only once the family's object exists).
  void finish_construction();
  const FusedOptions& options_of(size_t group) const;
  FusedParamState& state_of(const at::Tensor& p);
  template <class State> State& state_as(const at::Tensor& p) { return static_cast<State&>(state_of(p)); }
  // The grads of `params`, for the op.
  static std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params);
  // A new state tensor of `p`: zeros of `dtype` in p's layout (channels_last stays channels_last:
  // the op walks each entry's tensors in one storage order).
  static at::Tensor state_zeros(const at::Tensor& p, at::ScalarType dtype = at::kFloat);
  // The masters of `params` for the op: [] without master weights, else one fp32 tensor each.
  std::vector<at::Tensor> masters(const std::vector<at::Tensor>& params, const FusedOptions& options);
  // Group tensors beside the step count ("exp_avg_sq" for NovoGrad), created by families.
  at::Tensor& group_tensor(size_t group, const std::string& key);
  // The same without creating it: undefined when the group has none.
  at::Tensor group_tensor_or_none(size_t group, const std::string& key) const;
  // Loss scaling as device scalars on `device` (copies made without a host sync).
  GradScaling scaling_on(const at::Device& device) const;

 private:
  at::Tensor& step_tensor_for(size_t group, const at::Device& device);
  // Creates `p`'s state object, its master (with master weights) and the family's tensors.
  void ensure_state(const at::Tensor& p, const FusedOptions& options);
  void sync_group_slots() const;
  // Refuses what would make group `index`'s op throw half-way through step(): run for every group
  // before any steps (fused_optimizer_step.cpp), on what changed since the group's lists were built.
  void check_step_inputs(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options) const;
  void check_grad(size_t index, size_t j, const at::Tensor& p) const;
  // Each group's lists and what they were built from (fused_optimizer_step.cpp); dropped when
  // load(), add_param_group() or set_master() change what a step reads.
  struct StepPlans;
  struct DeletePlans {
    void operator()(StepPlans* plans) const;
  };
  std::unique_ptr<StepPlans, DeletePlans> plans_;
  void forget_plans();
  // Whether group `index`'s lists still hold; takes in (after check_grad) grads that changed.
  bool plan_holds(size_t index, const FusedOptions& options);
  // Group `index`'s lists from its checked params with grads, after creating missing state.
  void build_plan(size_t index, const FusedOptions& options, std::vector<at::Tensor> with_grads);

  std::string name_;
  GradScaling scaling_;
  // The options groups were given, kept from the base constructor to finish_construction().
  std::vector<std::pair<size_t, std::unique_ptr<torch::optim::OptimizerOptions>>> pending_options_;
  // Per param group (same index as param_groups()): "step" and family tensors. Groups appended
  // through add_param_group get their slot lazily.
  mutable std::vector<std::map<std::string, at::Tensor>> group_tensors_;
};

// What a family's optimizer class shares with every other: its options and state classes, and
// the lists of state tensors its op takes.
template <class Options, class State> class MIXPREC_API FusedOptimizerOf : public FusedOptimizer {
 protected:
  using FusedOptimizer::FusedOptimizer;

  std::unique_ptr<FusedParamState> make_state() const override { return std::make_unique<State>(); }
  std::unique_ptr<FusedOptions> make_options() const override {
    if constexpr (std::is_default_constructible_v<Options>) {
      return std::make_unique<Options>();
    } else {
      return std::make_unique<Options>(0.0);  // an lr without default (SGD's) is never inherited
    }
  }
  const FusedOptions* cast_options(const torch::optim::OptimizerOptions& o) const override {
    return dynamic_cast<const Options*>(&o);
  }
  static const Options& options_as(const FusedOptions& o) { return static_cast<const Options&>(o); }
  // get(state) of every param, in order: the op's list of one state tensor.
  template <class Get> std::vector<at::Tensor> gather(const std::vector<at::Tensor>& params, Get get) {
    std::vector<at::Tensor> out;
    out.reserve(params.size());
    for (const auto& p : params) out.push_back(get(state_as<State>(p)));
    return out;
  }
};

}  // namespace mixprec::optim

// In a family's class body: its public constructors, over param groups or one list of params,
// with `Options` defaults (their default argument, e.g. `= {}`, as the optional last macro
// argument); clone(params) returning the family's own type, and the factory that
// FusedOptimizer::clone_base calls (a new `Family` with this one's defaults).
#define MIXPREC_FUSED_OPTIMIZER_CLASS(Family, Options, ...)                                                          \
 public:                                                                                                             \
  explicit Family(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults __VA_ARGS__); \
  explicit Family(std::vector<at::Tensor> params, Options defaults __VA_ARGS__)                                      \
      : Family({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}                       \
  std::unique_ptr<Family> clone(const std::vector<at::Tensor>& params) const {                                       \
    return std::unique_ptr<Family>(static_cast<Family*>(clone_base(params).release()));                              \
  }                                                                                                                  \
                                                                                                                     \
 protected:                                                                                                          \
  std::unique_ptr<FusedOptimizer> make_empty(const std::vector<torch::optim::OptimizerParamGroup>& groups)           \
      const override {                                                                                               \
    return std::make_unique<Family>(groups, static_cast<const Options&>(*defaults_));                                \
  }

// In a family's class body: the two steps every family implements (see FusedOptimizer).
#define MIXPREC_FUSED_OPTIMIZER_STEP()                                                                      \
 protected:                                                                                                 \
  void init_param_state(const at::Tensor& p, const FusedOptions& options, FusedParamState& state) override; \
  void step_group(size_t index, const GroupLists& lists, const FusedOptions& options, const StepArgs& args) override;
