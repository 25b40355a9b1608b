// CUDA registration of the fused LAMB op: every pass queued on the current stream, no host sync.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/lamb.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void lamb_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList master_params, const std::optional<at::Tensor>& step_tensor, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool bias_correction, bool grad_averaging,
               bool adam_w_mode, double max_grad_norm, bool use_nvlamb, int64_t step,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& global_grad_norm,
               const std::optional<at::Tensor>& local_norms, const std::optional<at::Tensor>& trust_norms) {
  lamb_impl(params, grads, exp_avgs, exp_avg_sqs, master_params, step_tensor, lr, beta1, beta2, eps, weight_decay,
            bias_correction, grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, step, lr_tensor, grad_scale,
            found_inf, global_grad_norm, local_norms, trust_norms,
            {[](float* s, const float* f) { kernels::increment_step_cuda(s, f, current_stream()); },
             [](const kernels::LambParams& p) { kernels::lamb_moments_cuda(p, current_stream()); },
             [](const kernels::LambParams& p) { kernels::lamb_apply_cuda(p, current_stream()); },
             {[](const kernels::NormParams& p) { kernels::norm_partials_cuda(p, current_stream()); },
              [](const kernels::NormFinalizeParams& p) { kernels::norm_finalize_cuda(p, current_stream()); }}});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("lamb_", &lamb_cuda); }

}  // namespace mixprec::detail
