// CUDA registration of the fused Adagrad op: step increment and update on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/adagrad.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void adagrad_cuda(at::TensorList params, at::TensorList grads, at::TensorList state_sums, at::TensorList master_params,
                  const std::optional<at::Tensor>& step_tensor, double lr, double eps, double weight_decay,
                  double lr_decay, bool adagrad_w_mode, bool maximize, int64_t step,
                  const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) {
  adagrad_impl(params, grads, state_sums, master_params, step_tensor, lr, eps, weight_decay, lr_decay, adagrad_w_mode,
               maximize, step, lr_tensor, grad_scale, found_inf,
               {[](float* s, const float* f) { kernels::increment_step_cuda(s, f, current_stream()); },
                [](const kernels::AdagradParams& p) { kernels::adagrad_cuda(p, current_stream()); }});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("adagrad_", &adagrad_cuda); }

}  // namespace mixprec::detail
