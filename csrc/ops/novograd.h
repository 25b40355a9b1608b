// Ops-tier implementation of the fused NovoGrad op, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "kernels/norm.h"
#include "kernels/novograd.h"

namespace mixprec::detail {

// The backend's pieces, run in this order: gradient-norm partials per group and their per-tensor
// finalize (the norm machinery of kernels/norm.h), the step increment, the moment update, and
// the element-wise pass per group.
struct NovoGradRunners {
  void (*norm_partials)(const kernels::NormParams&);
  void (*norm_finalize)(const kernels::NormFinalizeParams&);
  void (*increment_step)(float* step_tensor, const float* found_inf);
  void (*moment)(const kernels::NovoGradMomentParams&);
  void (*step)(const kernels::NovoGradParams&);
};

void novograd_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, const at::Tensor& exp_avg_sq_norms,
                   at::TensorList master_params, const std::optional<at::Tensor>& step_tensor, double lr, double beta1,
                   double beta2, double eps, double weight_decay, bool bias_correction, bool grad_averaging,
                   bool reg_inside_moment, double norm_type, bool init_zero, int64_t step,
                   const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_norms,
                   NovoGradRunners run);

// Checks that do not need data (list lengths, exp_avg_sq_norms' size), shared with the Meta impl.
void novograd_check_shapes(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           const at::Tensor& exp_avg_sq_norms, at::TensorList master_params,
                           const std::optional<at::Tensor>& grad_norms);

}  // namespace mixprec::detail
