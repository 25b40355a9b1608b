// Ops-tier implementation of the fused Adagrad op, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "kernels/adagrad.h"

namespace mixprec::detail {

struct AdagradRunners {
  void (*increment_step)(float* step_tensor, const float* found_inf);
  void (*step)(const kernels::AdagradParams&);
};

void adagrad_impl(at::TensorList params, at::TensorList grads, at::TensorList state_sums, at::TensorList master_params,
                  const std::optional<at::Tensor>& step_tensor, double lr, double eps, double weight_decay,
                  double lr_decay, bool adagrad_w_mode, bool maximize, int64_t step,
                  const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf, AdagradRunners run);

}  // namespace mixprec::detail
