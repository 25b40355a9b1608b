// CPU registration of the fused Adam/AdamW op: chunks spread over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/adam.h"

namespace mixprec::detail {
namespace {

void run_adam(const kernels::AdamParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::adam_cpu(p, b, e); });
}

void adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList master_params, const std::optional<at::Tensor>& step_tensor,
              double lr, double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
              bool bias_correction, bool maximize, int64_t step, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  adam_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, step_tensor, lr, beta1, beta2, eps,
            weight_decay, adam_w_mode, bias_correction, maximize, step, lr_tensor, grad_scale, found_inf,
            {kernels::increment_step_cpu, run_adam});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) { m.impl("adam_", &adam_cpu); }

}  // namespace mixprec::detail
