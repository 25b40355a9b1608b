// Validation and packing for the fused SGD op (see sgd.h); kernels run per backend.
#include "ops/sgd.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "ops/optim_common.h"

namespace mixprec::detail {

void sgd_impl(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList master_params,
              const std::optional<at::Tensor>& step_tensor, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool wd_after_momentum, bool maximize, int64_t step,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf, SgdRunners run) {
  constexpr const char* kOp = "sgd_";
  check_range(kOp, "momentum", momentum, 0.0, INFINITY, /*hi_open=*/true);
  // torch.optim.SGD accepts any dampening; only a non-finite one is nonsense.
  TORCH_CHECK_VALUE(std::isfinite(dampening), arg_name(kOp, "dampening"), " must be finite, got ", num(dampening));
  check_range(kOp, "weight_decay", weight_decay, 0.0, INFINITY, true);
  TORCH_CHECK_VALUE(!nesterov || (momentum > 0 && dampening == 0), arg_name(kOp, "nesterov"),
                    " requires momentum > 0 and dampening == 0, got momentum ", num(momentum), " and dampening ",
                    num(dampening));
  const bool use_momentum = momentum != 0;
  TORCH_CHECK_VALUE(use_momentum == present(momentum_buffers) || params.empty(), arg_name(kOp, "momentum_buffers"),
                    use_momentum ? " must hold one float32 buffer per param when momentum != 0"
                                 : " must be empty when momentum == 0");
  if (params.empty()) {
    TORCH_CHECK_VALUE(grads.empty() && momentum_buffers.empty() && master_params.empty(), arg_name(kOp, "params"),
                      " is empty but other lists are not");
    return;
  }
  const at::Device device = op_device(kOp, {"params", params}, std::nullopt);
  // The step count only decides whether this is momentum's first step.
  const kernels::StepScalars scalars =
      step_scalars(kOp, device, step_tensor, step, lr, lr_tensor, grad_scale, found_inf, /*needs_step=*/use_momentum);

  const NamedList param_list{"params", params};
  const bool has_master = present(master_params);
  const NamedList momentum_list = use_momentum ? NamedList{"momentum_buffers", momentum_buffers} : param_list;
  const NamedList master_list = master_list_or(master_params, param_list);
  if (use_momentum) check_state_dtypes(kOp, momentum_list, /*allow_bf16=*/false);
  if (has_master) check_state_dtypes(kOp, master_list, /*allow_bf16=*/false);

  // Absent lists are stood in for by params: the kernels never touch them (see kernels/sgd.h).
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(grads), momentum_list, master_list}, device, kInPlaceUpdate);

  const c10::DeviceGuard guard(device);
  if (step_tensor) run.increment_step(step_tensor_ptr(step_tensor), scalars.found_inf);
  for (const kernels::TensorGroup& g : packed.groups) {
    kernels::SgdParams p;
    p.group = &g;
    p.scalars = scalars;
    p.momentum = static_cast<float>(momentum);
    p.dampening = static_cast<float>(dampening);
    p.weight_decay = static_cast<float>(weight_decay);
    p.nesterov = nesterov;
    p.wd_after_momentum = wd_after_momentum;
    p.maximize = maximize;
    p.has_master = has_master;
    run.step(p);
  }
}

}  // namespace mixprec::detail
