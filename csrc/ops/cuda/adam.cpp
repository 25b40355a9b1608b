// CUDA registration of the fused Adam/AdamW op: step increment and update on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/adam.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList master_params, const std::optional<at::Tensor>& step_tensor,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
               bool bias_correction, bool maximize, int64_t step, const std::optional<at::Tensor>& lr_tensor,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  adam_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, step_tensor, lr, beta1, beta2, eps,
            weight_decay, adam_w_mode, bias_correction, maximize, step, lr_tensor, grad_scale, found_inf,
            {[](float* s, const float* f) { kernels::increment_step_cuda(s, f, current_stream()); },
             [](const kernels::AdamParams& p) { kernels::adam_cuda(p, current_stream()); }});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("adam_", &adam_cuda); }

}  // namespace mixprec::detail
