// Validation and packing for the fused Adam/AdamW op (declared in mixprec/optim_args.h); the
// kernels run through each backend's AdamRunners (ops/optim.h).

#include <cmath>

#include "ops/optim.h"
#include "ops/optim_common.h"

namespace mixprec::detail {

void adam_impl(const AdamInputs& in, const AdamRunners& run, bool validate_only) {
  constexpr const char* kOp = "adam_";
  const AdamArgs& a = in.args;
  check_range(kOp, "beta1", a.beta1, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "beta2", a.beta2, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "eps", a.eps, 0.0, INFINITY, true);
  check_range(kOp, "weight_decay", a.weight_decay, 0.0, INFINITY, true);
  if (nothing_to_step(kOp, in)) return;
  const at::Device device = op_device(kOp, {"params", in.params}, std::nullopt);
  const kernels::StepScalars scalars = step_scalars(kOp, device, in.step, a.bias_correction || a.stochastic_rounding);

  const NamedList param_list{"params", in.params}, avg_list{"exp_avgs", in.exp_avgs},
      sq_list{"exp_avg_sqs", in.exp_avg_sqs};
  check_state_dtypes(kOp, avg_list, /*allow_bf16=*/true);
  check_state_dtypes(kOp, sq_list, true, &avg_list);
  const bool amsgrad = present(in.max_exp_avg_sqs);
  const WeightLists weights =
      weight_lists(kOp, in.params, in.master_params, a.stochastic_rounding, a.seed, kernels::AdamParams{}.weights);
  const NamedList max_list = amsgrad ? NamedList{"max_exp_avg_sqs", in.max_exp_avg_sqs} : param_list;
  const NamedList master_list = weights.master_list(param_list);
  if (amsgrad) check_state_dtypes(kOp, max_list, true, &avg_list);

  // Absent lists are stood in for by params: the kernels never touch them (see kernels/adam.h).
  const PackedLists packed = pack_lists(
      kOp, {param_list, grad_list(in.grads), avg_list, sq_list, max_list, master_list}, device, kInPlaceUpdate);
  if (validate_only) return;

  kernels::AdamParams p;
  p.scalars = scalars;
  p.args = a;
  p.one_minus_beta1 = static_cast<float>(1.0 - a.beta1);
  p.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  p.log_beta1 = static_cast<float>(std::log(a.beta1));  // -inf for beta1 = 0: bias correction 1
  p.log_beta2 = static_cast<float>(std::log(a.beta2));
  p.amsgrad = amsgrad;
  p.weights = weights.mode;
  run_update(run, packed, device, in.step, p);
}

}  // namespace mixprec::detail
