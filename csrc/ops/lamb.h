// Ops-tier implementation of the fused LAMB op, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "kernels/lamb.h"
#include "ops/norm.h"

namespace mixprec::detail {

struct LambRunners {
  void (*increment_step)(float* step_tensor, const float* found_inf);
  void (*moments)(const kernels::LambParams&);  // pass 1, per group
  void (*apply)(const kernels::LambParams&);    // pass 2, per group
  NormRunners norm;  // the global gradient norm when none is given; finalize gives per-tensor norms
};

void lamb_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList master_params, const std::optional<at::Tensor>& step_tensor, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool bias_correction, bool grad_averaging,
               bool adam_w_mode, double max_grad_norm, bool use_nvlamb, int64_t step,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& global_grad_norm,
               const std::optional<at::Tensor>& local_norms, const std::optional<at::Tensor>& trust_norms,
               LambRunners run);

// Checks that do not need data (list lengths, the split step's norm shapes), shared with the Meta impl.
void lamb_check_shapes(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList master_params,
                       const std::optional<at::Tensor>& local_norms, const std::optional<at::Tensor>& trust_norms);

}  // namespace mixprec::detail
