// Validation and packing for the fused SGD op (declared in mixprec/optim_args.h); the kernels
// run through each backend's SgdRunners (ops/optim.h).

#include <cmath>

#include "ops/optim.h"
#include "ops/optim_common.h"

namespace mixprec::detail {
namespace {

// Momentum is float32, or the param's own dtype: Apex's FusedSGD and torch.optim.SGD keep an
// fp16/bf16 param's buffer in its dtype, and the kernels store it as such (one rounding a step).
void check_momentum_dtypes(const char* op, const NamedList& momentum, const NamedList& params) {
  for (size_t i = 0; i < momentum.tensors.size() && i < params.tensors.size(); ++i) {
    const at::Tensor& m = momentum.tensors[i];
    const at::Tensor& p = params.tensors[i];
    if (!m.defined() || !p.defined()) continue;  // reported by pack_lists with its index
    const auto dt = m.scalar_type();
    MIXPREC_CHECK_TYPE(dt == at::kFloat || dt == p.scalar_type(), arg_name(op, momentum.name, static_cast<int64_t>(i)),
                       " has dtype ", dt, " but ", arg_name(op, params.name, static_cast<int64_t>(i)), " is ",
                       p.scalar_type(), "; a momentum buffer must be float32 or its param's dtype");
  }
}

}  // namespace

void sgd_impl(const SgdInputs& in, const SgdRunners& run, bool validate_only) {
  constexpr const char* kOp = "sgd_";
  const SgdArgs& a = in.args;
  const double momentum = a.momentum, dampening = a.dampening;
  check_range(kOp, "momentum", momentum, 0.0, INFINITY, /*hi_open=*/true);
  // torch.optim.SGD accepts any dampening; only a non-finite one is nonsense.
  MIXPREC_CHECK_VALUE(std::isfinite(dampening), arg_name(kOp, "dampening"), " must be finite, got ", num(dampening));
  check_range(kOp, "weight_decay", a.weight_decay, 0.0, INFINITY, true);
  MIXPREC_CHECK_VALUE(!a.nesterov || (momentum > 0 && dampening == 0), arg_name(kOp, "nesterov"),
                      " requires momentum > 0 and dampening == 0, got momentum ", num(momentum), " and dampening ",
                      num(dampening));
  const bool use_momentum = momentum != 0;
  MIXPREC_CHECK_VALUE(use_momentum == present(in.momentum_buffers) || in.params.empty(),
                      arg_name(kOp, "momentum_buffers"),
                      use_momentum ? " must hold one buffer (float32 or the param's dtype) per param when momentum != 0"
                                   : " must be empty when momentum == 0");
  if (nothing_to_step(kOp, in)) return;
  const at::Device device = op_device(kOp, {"params", in.params}, std::nullopt);
  // The step count only decides whether this is momentum's first step.
  const kernels::StepScalars scalars =
      step_scalars(kOp, device, in.step, /*needs_step=*/use_momentum || a.stochastic_rounding);

  const NamedList param_list{"params", in.params};
  const WeightLists weights =
      weight_lists(kOp, in.params, in.master_params, a.stochastic_rounding, a.seed, kernels::SgdParams{}.weights);
  const NamedList momentum_list = use_momentum ? NamedList{"momentum_buffers", in.momentum_buffers} : param_list;
  const NamedList master_list = weights.master_list(param_list);
  if (use_momentum) check_momentum_dtypes(kOp, momentum_list, param_list);

  // Absent lists are stood in for by params: the kernels never touch them (see kernels/sgd.h).
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(in.grads), momentum_list, master_list}, device, kInPlaceUpdate);
  if (validate_only) return;

  kernels::SgdParams p;
  p.scalars = scalars;
  p.args = a;
  p.weights = weights.mode;
  run_update(run, packed, device, in.step, p);
}

}  // namespace mixprec::detail
