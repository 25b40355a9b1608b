// The fused optimizer ops' ops tier, made from each family's declaration (mixprec/optim_args.h):
// the inputs of one call as read off the dispatcher's stack, each backend's runners, the
// validation/packing impls (ops/<family>.cpp), and the boxed kernel that joins them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <vector>

#include <c10/core/DeviceGuard.h>
#include <mixprec/ops.h>  // StepArgs, the Args structs

#include "kernels/adagrad.h"
#include "kernels/adam.h"
#include "kernels/lamb.h"
#include "kernels/norm.h"
#include "kernels/novograd.h"
#include "kernels/sgd.h"
#include "ops/norm.h"
#include "ops/optim_common.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {

// ---- the inputs of one call ------------------------------------------------------------------
inline void read_value(const c10::IValue& v, std::vector<at::Tensor>& out) { out = v.toTensorVector(); }
inline void read_value(const c10::IValue& v, at::Tensor& out) { out = v.toTensor(); }
inline void read_value(const c10::IValue& v, std::optional<at::Tensor>& out) { out = v.toOptional<at::Tensor>(); }
inline void read_value(const c10::IValue& v, double& out) { out = v.toDouble(); }
inline void read_value(const c10::IValue& v, bool& out) { out = v.toBool(); }
inline void read_value(const c10::IValue& v, int64_t& out) { out = v.toInt(); }

// A tensor list of the op, by name, for the checks every family shares.
struct ListRef {
  const char* list_name;
  const std::vector<at::Tensor>* tensors;
};

#define MIXPREC_OPTIM_TYPE_LIST std::vector<at::Tensor>
#define MIXPREC_OPTIM_TYPE_TENSOR at::Tensor
#define MIXPREC_OPTIM_MEMBER(kind, name, alias) MIXPREC_OPTIM_TYPE_##kind name;
#define MIXPREC_OPTIM_EXTRA_MEMBER(name, alias) std::optional<at::Tensor> name;
#define MIXPREC_OPTIM_READ(kind, name, alias) read_value(*it++, name);
#define MIXPREC_OPTIM_READ_EXTRA(name, alias) read_value(*it++, name);
#define MIXPREC_OPTIM_READ_ARG(type, name, default_value) read_value(*it++, args.name);
#define MIXPREC_OPTIM_REF_LIST(name) ListRef{#name, &name},
#define MIXPREC_OPTIM_REF_TENSOR(name)
#define MIXPREC_OPTIM_REF(kind, name, alias) MIXPREC_OPTIM_REF_##kind(name)

// Struct##Inputs: one call of the family's op, its members named as in the schema; read() takes
// the arguments in schema order (library.cpp builds the schema from the same lists).
#define MIXPREC_DEFINE_OPTIM_INPUTS(op, Struct, MACRO)                                            \
  struct Struct##Inputs {                                                                         \
    MIXPREC_##MACRO##_TENSORS(MIXPREC_OPTIM_MEMBER) Struct##Args args;                            \
    StepArgs step;                                                                                \
    MIXPREC_##MACRO##_EXTRAS(MIXPREC_OPTIM_EXTRA_MEMBER) void read(const c10::IValue* it) {       \
      MIXPREC_##MACRO##_TENSORS(MIXPREC_OPTIM_READ) read_value(*it++, step.step_tensor);          \
      read_value(*it++, step.lr);                                                                 \
      MIXPREC_##MACRO##_ARGS(MIXPREC_OPTIM_READ_ARG) read_value(*it++, step.step);                \
      read_value(*it++, step.lr_tensor);                                                          \
      read_value(*it++, step.grad_scale);                                                         \
      read_value(*it++, step.found_inf);                                                          \
      MIXPREC_##MACRO##_EXTRAS(MIXPREC_OPTIM_READ_EXTRA)                                          \
    }                                                                                             \
    std::vector<ListRef> lists() const { return {MIXPREC_##MACRO##_TENSORS(MIXPREC_OPTIM_REF)}; } \
  };
MIXPREC_OPTIM_FAMILIES(MIXPREC_DEFINE_OPTIM_INPUTS)
#undef MIXPREC_DEFINE_OPTIM_INPUTS

// The one empty-list rule of every family, called by each impl once its hyper-parameters are
// checked: params empty means a step over nothing, which returns at once (true) provided every
// other tensor list is empty too; nothing is touched, not even step_tensor.
template <class Inputs> bool nothing_to_step(const char* op, const Inputs& in) {
  if (!in.params.empty()) return false;
  for (const ListRef& l : in.lists())
    MIXPREC_CHECK_VALUE(l.tensors->empty(), arg_name(op, "params"), " is empty but ", l.list_name, " has ",
                        num(l.tensors->size()), " tensors");
  return true;
}

// Points p at group g and sets the group's weight mode: its masters are remainders when they
// packed as bfloat16 (weight_lists' views of int16; fp32 masters pack as float32), and stochastic
// rounding applies to its params when they are bfloat16 and have no master.
template <class Params> void set_group(Params& p, const kernels::TensorGroup& g) {
  p.group = &g;
  kernels::WeightMode& m = p.weights;
  m.remainder = m.has_master && g.dtypes[m.master_list] == kernels::DType::kBFloat16;
  m.stochastic = p.args.stochastic_rounding && !m.has_master && g.dtypes[m.param_list] == kernels::DType::kBFloat16;
}

// ---- each backend's pieces, called by the impls in this order ------------------------------
using IncrementStep = void (*)(float* step_tensor, const float* found_inf);

// The end of a single-pass family's step, after its checks: count the step on the device (the
// kernel leaves it alone when found_inf is set) and run the update over every packed group.
template <class Params, class Runners>
void run_update(const Runners& run, const PackedLists& packed, const at::Device& device, const StepArgs& step,
                Params& p) {
  const c10::DeviceGuard guard(device);
  if (step.step_tensor) run.increment_step(step_tensor_ptr(step.step_tensor), p.scalars.found_inf);
  for (const kernels::TensorGroup& g : packed.groups) {
    set_group(p, g);
    run.step(p);
  }
}

struct AdamRunners {
  IncrementStep increment_step;
  void (*step)(const kernels::AdamParams&);
};

struct SgdRunners {
  IncrementStep increment_step;
  void (*step)(const kernels::SgdParams&);
};

struct LambRunners {
  IncrementStep increment_step;
  void (*moments)(const kernels::LambParams&);  // pass 1, per group
  void (*apply)(const kernels::LambParams&);    // pass 2, per group
  NormRunners norm;  // the global gradient norm when none is given; finalize gives per-tensor norms
};

struct AdagradRunners {
  IncrementStep increment_step;
  void (*step)(const kernels::AdagradParams&);
};

// Gradient-norm partials per group and their per-tensor finalize (kernels/norm.h), the step
// increment, the moment update, and the element-wise pass per group.
struct NovoGradRunners {
  NormRunners norm;
  IncrementStep increment_step;
  void (*moment)(const kernels::NovoGradMomentParams&);
  void (*step)(const kernels::NovoGradParams&);
};

// ---- the impls (ops/<family>.cpp) ------------------------------------------------------------
// Every check the step makes, then (unless validate_only) the step through `run`. A refused call,
// and every validate_only call, writes nothing.
void adam_impl(const AdamInputs& in, const AdamRunners& run, bool validate_only);
void sgd_impl(const SgdInputs& in, const SgdRunners& run, bool validate_only);
void lamb_impl(const LambInputs& in, const LambRunners& run, bool validate_only);
void adagrad_impl(const AdagradInputs& in, const AdagradRunners& run, bool validate_only);
void novograd_impl(const NovoGradInputs& in, const NovoGradRunners& run, bool validate_only);

// ---- the boxed kernel ------------------------------------------------------------------------
// Reads the call off the stack into the family's Inputs and runs its impl with one backend's
// runners: the step (`<op>_`) or its validate-only twin (`<op>_check`).
template <class Inputs, class Runners> class OptimKernel final : public c10::OperatorKernel {
 public:
  using Impl = void (*)(const Inputs&, const Runners&, bool);
  OptimKernel(Impl impl, Runners run, bool validate_only) : impl_(impl), run_(run), validate_only_(validate_only) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    Inputs in;
    in.read(torch::jit::last(*stack, n).data());
    torch::jit::drop(*stack, n);
    impl_(in, run_, validate_only_);
  }

 private:
  Impl impl_;
  Runners run_;
  bool validate_only_;
};

template <class Inputs, class Runners>
void register_optim(torch::Library& m, const char* op, const char* check,
                    void (*impl)(const Inputs&, const Runners&, bool), const Runners& run) {
  m.impl(op,
         torch::CppFunction::makeFromBoxedFunctor(std::make_unique<OptimKernel<Inputs, Runners>>(impl, run, false)));
  m.impl(check,
         torch::CppFunction::makeFromBoxedFunctor(std::make_unique<OptimKernel<Inputs, Runners>>(impl, run, true)));
}

}  // namespace mixprec::detail

// Registers family `op` (adam, sgd, ...) and its validate-only twin for dispatch key KEY, with
// that backend's runners (a <Family>Runners value): the one line a backend writes per family.
#define MIXPREC_REGISTER_OPTIM(op, KEY, runners)                                                         \
  TORCH_LIBRARY_IMPL(mixprec, KEY, m) {                                                                  \
    ::mixprec::detail::register_optim(m, #op "_", #op "_check", &::mixprec::detail::op##_impl, runners); \
  }
