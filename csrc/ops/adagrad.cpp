// Validation and packing for the fused Adagrad op (see adagrad.h); kernels run per backend.
#include "ops/adagrad.h"

#include <c10/core/DeviceGuard.h>

#include "ops/optim_common.h"

namespace mixprec::detail {

void adagrad_impl(at::TensorList params, at::TensorList grads, at::TensorList state_sums, at::TensorList master_params,
                  const std::optional<at::Tensor>& step_tensor, double lr, double eps, double weight_decay,
                  double lr_decay, bool adagrad_w_mode, bool maximize, int64_t step,
                  const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf, AdagradRunners run) {
  constexpr const char* kOp = "adagrad_";
  check_range(kOp, "eps", eps, 0.0, INFINITY, /*hi_open=*/true);
  check_range(kOp, "weight_decay", weight_decay, 0.0, INFINITY, true);
  check_range(kOp, "lr_decay", lr_decay, 0.0, INFINITY, true);
  if (params.empty()) {
    TORCH_CHECK_VALUE(grads.empty() && state_sums.empty() && master_params.empty(), arg_name(kOp, "params"),
                      " is empty but other lists are not");
    return;
  }
  const at::Device device = op_device(kOp, {"params", params}, std::nullopt);
  // The step count only enters through lr_decay.
  const kernels::StepScalars scalars =
      step_scalars(kOp, device, step_tensor, step, lr, lr_tensor, grad_scale, found_inf, /*needs_step=*/lr_decay != 0);

  const NamedList param_list{"params", params}, sum_list{"state_sums", state_sums};
  const bool has_master = present(master_params);
  const NamedList master_list = master_list_or(master_params, param_list);
  check_state_dtypes(kOp, sum_list, /*allow_bf16=*/false);
  if (has_master) check_state_dtypes(kOp, master_list, /*allow_bf16=*/false);

  // An absent master list is stood in for by params: the kernels never touch it.
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(grads), sum_list, master_list}, device, kInPlaceUpdate);

  const c10::DeviceGuard guard(device);
  if (step_tensor) run.increment_step(step_tensor_ptr(step_tensor), scalars.found_inf);
  for (const kernels::TensorGroup& g : packed.groups) {
    kernels::AdagradParams p;
    p.group = &g;
    p.scalars = scalars;
    p.eps = static_cast<float>(eps);
    p.weight_decay = static_cast<float>(weight_decay);
    p.lr_decay = static_cast<float>(lr_decay);
    p.adagrad_w_mode = adagrad_w_mode;
    p.maximize = maximize;
    p.has_master = has_master;
    run.step(p);
  }
}

}  // namespace mixprec::detail
