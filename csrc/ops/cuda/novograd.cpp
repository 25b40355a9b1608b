// CUDA registration of the fused NovoGrad op: norms, step increment, moment update and
// element-wise pass all queued on the current stream, with no host synchronization.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/novograd.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void novograd_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, const at::Tensor& exp_avg_sq_norms,
                   at::TensorList master_params, const std::optional<at::Tensor>& step_tensor, double lr, double beta1,
                   double beta2, double eps, double weight_decay, bool bias_correction, bool grad_averaging,
                   bool reg_inside_moment, double norm_type, bool init_zero, int64_t step,
                   const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_norms) {
  novograd_impl(params, grads, exp_avgs, exp_avg_sq_norms, master_params, step_tensor, lr, beta1, beta2, eps,
                weight_decay, bias_correction, grad_averaging, reg_inside_moment, norm_type, init_zero, step, lr_tensor,
                grad_scale, found_inf, grad_norms,
                {[](const kernels::NormParams& p) { kernels::norm_partials_cuda(p, current_stream()); },
                 [](const kernels::NormFinalizeParams& p) { kernels::norm_finalize_cuda(p, current_stream()); },
                 [](float* s, const float* f) { kernels::increment_step_cuda(s, f, current_stream()); },
                 [](const kernels::NovoGradMomentParams& p) { kernels::novograd_moment_cuda(p, current_stream()); },
                 [](const kernels::NovoGradParams& p) { kernels::novograd_cuda(p, current_stream()); }});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("novograd_", &novograd_cuda); }

}  // namespace mixprec::detail
