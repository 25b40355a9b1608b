// CUDA registration of the fused SGD op: step increment and update on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/sgd.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList master_params,
              const std::optional<at::Tensor>& step_tensor, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool wd_after_momentum, bool maximize, int64_t step,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf) {
  sgd_impl(params, grads, momentum_buffers, master_params, step_tensor, lr, momentum, dampening, weight_decay, nesterov,
           wd_after_momentum, maximize, step, lr_tensor, grad_scale, found_inf,
           {[](float* s, const float* f) { kernels::increment_step_cuda(s, f, current_stream()); },
            [](const kernels::SgdParams& p) { kernels::sgd_cuda(p, current_stream()); }});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("sgd_", &sgd_cuda); }

}  // namespace mixprec::detail
