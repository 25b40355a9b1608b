// Validation and packing for the fused Adam/AdamW op (see adam.h); kernels run per backend.
#include "ops/adam.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "ops/optim_common.h"

namespace mixprec::detail {

void adam_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList master_params, const std::optional<at::Tensor>& step_tensor,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
               bool bias_correction, bool maximize, int64_t step, const std::optional<at::Tensor>& lr_tensor,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               AdamRunners run) {
  constexpr const char* kOp = "adam_";
  check_range(kOp, "beta1", beta1, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "beta2", beta2, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "eps", eps, 0.0, INFINITY, true);
  check_range(kOp, "weight_decay", weight_decay, 0.0, INFINITY, true);
  if (params.empty()) {
    TORCH_CHECK_VALUE(grads.empty() && exp_avgs.empty() && exp_avg_sqs.empty() && max_exp_avg_sqs.empty() &&
                          master_params.empty(),
                      arg_name(kOp, "params"), " is empty but other lists are not");
    return;
  }
  const at::Device device = op_device(kOp, {"params", params}, std::nullopt);
  const kernels::StepScalars scalars =
      step_scalars(kOp, device, step_tensor, step, lr, lr_tensor, grad_scale, found_inf, bias_correction);

  const NamedList param_list{"params", params}, avg_list{"exp_avgs", exp_avgs}, sq_list{"exp_avg_sqs", exp_avg_sqs};
  check_state_dtypes(kOp, avg_list, /*allow_bf16=*/true);
  check_state_dtypes(kOp, sq_list, true, &avg_list);
  const bool amsgrad = present(max_exp_avg_sqs);
  const bool has_master = present(master_params);
  const NamedList max_list = amsgrad ? NamedList{"max_exp_avg_sqs", max_exp_avg_sqs} : param_list;
  const NamedList master_list = master_list_or(master_params, param_list);
  if (amsgrad) check_state_dtypes(kOp, max_list, true, &avg_list);
  if (has_master) check_state_dtypes(kOp, master_list, /*allow_bf16=*/false);

  // Absent lists are stood in for by params: the kernels never touch them (see kernels/adam.h).
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(grads), avg_list, sq_list, max_list, master_list}, device, kInPlaceUpdate);

  const c10::DeviceGuard guard(device);
  if (step_tensor) run.increment_step(step_tensor_ptr(step_tensor), scalars.found_inf);
  for (const kernels::TensorGroup& g : packed.groups) {
    kernels::AdamParams p;
    p.group = &g;
    p.scalars = scalars;
    p.beta1 = static_cast<float>(beta1);
    p.beta2 = static_cast<float>(beta2);
    p.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    p.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    p.log_beta1 = static_cast<float>(std::log(beta1));  // -inf for beta1 = 0: bias correction 1
    p.log_beta2 = static_cast<float>(std::log(beta2));
    p.eps = static_cast<float>(eps);
    p.weight_decay = static_cast<float>(weight_decay);
    p.adam_w_mode = adam_w_mode;
    p.bias_correction = bias_correction;
    p.amsgrad = amsgrad;
    p.has_master = has_master;
    p.maximize = maximize;
    run.step(p);
  }
}

}  // namespace mixprec::detail
