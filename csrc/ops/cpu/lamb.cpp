// CPU registration of the fused LAMB op: each pass's chunks spread over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/lamb.h"

namespace mixprec::detail {
namespace {

void run_moments(const kernels::LambParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::lamb_moments_cpu(p, b, e); });
}

void run_apply(const kernels::LambParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::lamb_apply_cpu(p, b, e); });
}

void run_norm_partials(const kernels::NormParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::norm_partials_cpu(p, b, e); });
}

void lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList master_params, const std::optional<at::Tensor>& step_tensor, double lr, double beta1,
              double beta2, double eps, double weight_decay, bool bias_correction, bool grad_averaging,
              bool adam_w_mode, double max_grad_norm, bool use_nvlamb, int64_t step,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& global_grad_norm,
              const std::optional<at::Tensor>& local_norms, const std::optional<at::Tensor>& trust_norms) {
  lamb_impl(params, grads, exp_avgs, exp_avg_sqs, master_params, step_tensor, lr, beta1, beta2, eps, weight_decay,
            bias_correction, grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, step, lr_tensor, grad_scale,
            found_inf, global_grad_norm, local_norms, trust_norms,
            {kernels::increment_step_cpu, run_moments, run_apply, {run_norm_partials, kernels::norm_finalize_cpu}});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) { m.impl("lamb_", &lamb_cpu); }

}  // namespace mixprec::detail
