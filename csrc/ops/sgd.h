// Ops-tier implementation of the fused SGD op, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "kernels/sgd.h"

namespace mixprec::detail {

struct SgdRunners {
  void (*increment_step)(float* step_tensor, const float* found_inf);
  void (*step)(const kernels::SgdParams&);
};

void sgd_impl(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList master_params,
              const std::optional<at::Tensor>& step_tensor, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool wd_after_momentum, bool maximize, int64_t step,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf, SgdRunners run);

}  // namespace mixprec::detail
