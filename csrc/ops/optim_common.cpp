// Validation shared by the fused optimizer ops (see optim_common.h).
#include "ops/optim_common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

namespace mixprec::detail {

kernels::StepScalars step_scalars(const char* op, const at::Device& device, const StepArgs& in, bool needs_step) {
  const std::optional<at::Tensor>& step_tensor = in.step_tensor;
  const std::optional<at::Tensor>& lr_tensor = in.lr_tensor;
  const std::optional<at::Tensor>& grad_scale = in.grad_scale;
  const std::optional<at::Tensor>& found_inf = in.found_inf;
  const double lr = in.lr;
  const int64_t step = in.step;
  kernels::StepScalars s;
  if (step_tensor) {
    check_scalar_tensor(op, "step_tensor", *step_tensor, device);
    s.step_tensor = step_tensor->data_ptr<float>();
  } else {
    MIXPREC_CHECK_VALUE(!needs_step || step >= 1, arg_name(op, "step"),
                        " must be >= 1 (the count including this step) when no step_tensor is given, got ", num(step));
    s.step = static_cast<float>(step);
  }
  if (lr_tensor) {
    check_scalar_tensor(op, "lr_tensor", *lr_tensor, device);
    s.lr_tensor = lr_tensor->data_ptr<float>();
  } else {
    MIXPREC_CHECK_VALUE(std::isfinite(lr) && lr >= 0, arg_name(op, "lr"), " must be finite and >= 0, got ", num(lr));
    s.lr = static_cast<float>(lr);
  }
  if (grad_scale) {
    check_scalar_tensor(op, "grad_scale", *grad_scale, device);
    s.grad_scale = grad_scale->data_ptr<float>();
  }
  if (found_inf) {
    check_scalar_tensor(op, "found_inf", *found_inf, device);
    s.found_inf = found_inf->data_ptr<float>();
  }
  return s;
}

void check_range(const char* op, const char* name, double v, double lo, double hi, bool hi_open) {
  const bool ok = v >= lo && (hi_open ? v < hi : v <= hi);
  MIXPREC_CHECK_VALUE(ok, arg_name(op, name), " must be in [", num(lo), ", ", num(hi), hi_open ? ")" : "]", ", got ",
                      num(v));
}

void check_state_dtypes(const char* op, const NamedList& list, bool allow_bf16, const NamedList* like) {
  for (size_t i = 0; i < list.tensors.size(); ++i) {
    const at::Tensor& t = list.tensors[i];
    if (!t.defined()) continue;  // reported by pack_lists with its index
    const auto dt = t.scalar_type();
    const bool ok = dt == at::kFloat || (allow_bf16 && dt == at::kBFloat16);
    MIXPREC_CHECK_TYPE(ok, arg_name(op, list.name, static_cast<int64_t>(i)), " has dtype ", dt,
                       "; optimizer state must be float32", allow_bf16 ? " or bfloat16" : "");
    if (like != nullptr && i < like->tensors.size() && like->tensors[i].defined())
      MIXPREC_CHECK_TYPE(dt == like->tensors[i].scalar_type(), arg_name(op, list.name, static_cast<int64_t>(i)),
                         " has dtype ", dt, " but ", arg_name(op, like->name, static_cast<int64_t>(i)), " has ",
                         like->tensors[i].scalar_type());
  }
}

WeightLists weight_lists(const char* op, at::TensorList params, at::TensorList master_params, bool stochastic_rounding,
                         int64_t seed, kernels::WeightMode mode) {
  WeightLists out;
  mode.has_master = !master_params.empty();
  mode.seed = static_cast<uint64_t>(seed);
  MIXPREC_CHECK_VALUE(!stochastic_rounding || master_params.empty(), arg_name(op, "stochastic_rounding"),
                      " rounds params kept without masters (pure bfloat16 training); master_params must be empty, got ",
                      num(master_params.size()), " tensors");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto index = static_cast<int64_t>(i);
    if (!stochastic_rounding || !params[i].defined()) continue;
    MIXPREC_CHECK_TYPE(params[i].scalar_type() != at::kHalf, arg_name(op, "params", index),
                       " is float16; stochastic_rounding rounds to bfloat16 (float32 params are stored exactly)");
  }
  for (size_t i = 0; i < master_params.size(); ++i) {
    const at::Tensor& m = master_params[i];
    const auto index = static_cast<int64_t>(i);
    if (!m.defined()) {
      out.masters.push_back(m);  // reported by pack_lists with its index
      continue;
    }
    if (m.scalar_type() == at::kShort) {
      const bool bf16 = i < params.size() && params[i].defined() && params[i].scalar_type() == at::kBFloat16;
      MIXPREC_CHECK_TYPE(bf16 || i >= params.size() || !params[i].defined(), arg_name(op, "master_params", index),
                         " is an int16 remainder, which needs a bfloat16 param; params[", num(index), "] is ",
                         params[i].scalar_type());
      out.masters.push_back(m.view(at::kBFloat16));
      continue;
    }
    MIXPREC_CHECK_TYPE(m.scalar_type() == at::kFloat, arg_name(op, "master_params", index), " has dtype ",
                       m.scalar_type(), "; expected float32 (an fp32 master) or int16 (the low half of a bfloat16 ",
                       "param's fp32 master)");
    out.masters.push_back(m);
  }
  out.mode = mode;
  return out;
}

namespace {

// A call whose lists are all empty and whose device scalars are all None carries no tensor for
// the dispatcher to pick a backend by (a filtered param list can come out empty, on either
// front). This one boxed kernel answers it for every multi-tensor op: it makes sure the call
// really holds no tensor, then runs the op's CPU kernel, which checks the hyper-parameters and the
// list lengths like any other call and has nothing to update. Backend kernels win whenever a
// tensor is present.
void no_tensors(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  for (const c10::IValue& v : torch::jit::last(*stack, op.schema().arguments().size())) {
    const bool tensor = (v.isTensor() && v.toTensor().defined()) || (v.isTensorList() && !v.toTensorList().empty());
    MIXPREC_CHECK(!tensor, std::string(op.schema().name()), ": no kernel for the device of the given tensors");
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// The Meta kernel of every optimizer op and its validate-only twin: they return nothing, so
// torch.compile's fake tensors need no shapes from them; list lengths are what is checkable
// without data. Each non-empty tensor list must match params' (arguments[0]) length; the rules
// on which lists may be empty (sgd's momentum_buffers ...) are the impls'. Every tensor must be on
// the meta device too (check_on_meta).
void optim_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::vector<c10::Argument>& args = op.schema().arguments();
  const auto in = torch::jit::last(*stack, args.size());
  const std::string name = op.schema().name().substr(sizeof("mixprec::") - 1);
  const size_t n = in[0].toTensorList().size();
  for (size_t i = 0; i < args.size(); ++i) {
    const char* arg = args[i].name().c_str();
    if (in[i].isTensor()) check_on_meta(name.c_str(), arg, in[i].toTensor());
    if (!in[i].isTensorList()) continue;
    const c10::List<at::Tensor> list = in[i].toTensorList();
    for (size_t j = 0; j < list.size(); ++j) check_on_meta(name.c_str(), arg, list.get(j), static_cast<int64_t>(j));
    const size_t k = list.size();
    MIXPREC_CHECK_VALUE(k == 0 || k == n, arg_name(name.c_str(), arg), " has ", num(k), " tensors but params has ",
                        num(n));
  }
  torch::jit::drop(*stack, args.size());
}

// The ADInplaceOrView kernel of every optimizer op (not the validate-only twins, which write
// nothing): after a step, the version counters of the tensors it wrote in place (params, masters,
// state, the step count) move on, as any in-place torch op's do. Autograd then refuses a backward
// through a graph that saved a weight the step changed (a forward, then step(), then backward),
// as it does for torch.optim, instead of computing gradients from the new weights; and caches
// keyed on versions (O1's casts of weights) see the change. Grads are left alone: the op writes
// them only to unscale them, and amp tracks their versions as its own marks (amp/_grad_marks.py).
// A refused call bumps nothing. Inference tensors have no version counter to move.
void optim_bump_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const std::vector<c10::Argument>& args = op.schema().arguments();
  // The written arguments as IValues: a list is kept by one reference, not one per tensor (the
  // held steps pass ~1500 tensors a step through here).
  std::vector<c10::IValue> written;
  {
    const auto in = torch::jit::last(*stack, args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::AliasInfo* alias = args[i].alias_info();
      if (alias != nullptr && alias->isWrite() && args[i].name() != "grads") written.push_back(in[i]);
    }
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  const auto bump = [](const at::Tensor& t) {
    if (t.defined() && !t.is_inference()) torch::autograd::impl::bump_version(t);
  };
  for (const c10::IValue& v : written) {
    if (v.isTensor()) {
      bump(v.toTensor());
    } else if (v.isTensorList()) {
      for (const c10::IValue& t : v.toListRef()) bump(t.toTensor());
    }
  }
}

}  // namespace

#define MIXPREC_OPTIM_OP_NAMES(op, Struct, MACRO) #op "_", #op "_check",

TORCH_LIBRARY_IMPL(mixprec, CompositeExplicitAutograd, m) {
  for (const char* name : {MIXPREC_OPTIM_FAMILIES(MIXPREC_OPTIM_OP_NAMES) "multi_tensor_norm"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&no_tensors>());
}

TORCH_LIBRARY_IMPL(mixprec, Meta, m) {
  for (const char* name : {MIXPREC_OPTIM_FAMILIES(MIXPREC_OPTIM_OP_NAMES)})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&optim_meta>());
}

#define MIXPREC_OPTIM_STEP_NAME(op, Struct, MACRO) #op "_",

TORCH_LIBRARY_IMPL(mixprec, ADInplaceOrView, m) {
  for (const char* name : {MIXPREC_OPTIM_FAMILIES(MIXPREC_OPTIM_STEP_NAME)})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&optim_bump_versions>());
}

}  // namespace mixprec::detail
