// Validation and packing for the fused Adagrad op (declared in mixprec/optim_args.h); the
// kernels run through each backend's AdagradRunners (ops/optim.h).

#include <cmath>

#include "ops/optim.h"
#include "ops/optim_common.h"

namespace mixprec::detail {

void adagrad_impl(const AdagradInputs& in, const AdagradRunners& run, bool validate_only) {
  constexpr const char* kOp = "adagrad_";
  const AdagradArgs& a = in.args;
  check_range(kOp, "eps", a.eps, 0.0, INFINITY, /*hi_open=*/true);
  check_range(kOp, "weight_decay", a.weight_decay, 0.0, INFINITY, true);
  check_range(kOp, "lr_decay", a.lr_decay, 0.0, INFINITY, true);
  if (nothing_to_step(kOp, in)) return;
  const at::Device device = op_device(kOp, {"params", in.params}, std::nullopt);
  // The step count only enters through lr_decay.
  const kernels::StepScalars scalars =
      step_scalars(kOp, device, in.step, /*needs_step=*/a.lr_decay != 0 || a.stochastic_rounding);

  const NamedList param_list{"params", in.params}, sum_list{"state_sums", in.state_sums};
  const WeightLists weights =
      weight_lists(kOp, in.params, in.master_params, a.stochastic_rounding, a.seed, kernels::AdagradParams{}.weights);
  const NamedList master_list = weights.master_list(param_list);
  check_state_dtypes(kOp, sum_list, /*allow_bf16=*/false);

  // An absent master list is stood in for by params: the kernels never touch it.
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(in.grads), sum_list, master_list}, device, kInPlaceUpdate);
  if (validate_only) return;

  kernels::AdagradParams p;
  p.scalars = scalars;
  p.args = a;
  p.weights = weights.mode;
  run_update(run, packed, device, in.step, p);
}

}  // namespace mixprec::detail
