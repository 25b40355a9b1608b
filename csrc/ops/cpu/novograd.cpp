// CPU registration of the fused NovoGrad op: norm partials and the element-wise pass spread
// over ATen's thread pool, the per-tensor finalize and moment update inline.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/novograd.h"

namespace mixprec::detail {
namespace {

void run_norm_partials(const kernels::NormParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::norm_partials_cpu(p, b, e); });
}

void run_novograd(const kernels::NovoGradParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::novograd_cpu(p, b, e); });
}

void novograd_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, const at::Tensor& exp_avg_sq_norms,
                  at::TensorList master_params, const std::optional<at::Tensor>& step_tensor, double lr, double beta1,
                  double beta2, double eps, double weight_decay, bool bias_correction, bool grad_averaging,
                  bool reg_inside_moment, double norm_type, bool init_zero, int64_t step,
                  const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_norms) {
  novograd_impl(params, grads, exp_avgs, exp_avg_sq_norms, master_params, step_tensor, lr, beta1, beta2, eps,
                weight_decay, bias_correction, grad_averaging, reg_inside_moment, norm_type, init_zero, step, lr_tensor,
                grad_scale, found_inf, grad_norms,
                {run_norm_partials, kernels::norm_finalize_cpu, kernels::increment_step_cpu,
                 kernels::novograd_moment_cpu, run_novograd});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) { m.impl("novograd_", &novograd_cpu); }

}  // namespace mixprec::detail
