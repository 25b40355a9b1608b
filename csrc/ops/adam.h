// Ops-tier implementation of the fused Adam/AdamW op, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "kernels/adam.h"

namespace mixprec::detail {

struct AdamRunners {
  void (*increment_step)(float* step_tensor, const float* found_inf);
  void (*step)(const kernels::AdamParams&);
};

void adam_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList master_params, const std::optional<at::Tensor>& step_tensor,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
               bool bias_correction, bool maximize, int64_t step, const std::optional<at::Tensor>& lr_tensor,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               AdamRunners run);

}  // namespace mixprec::detail
