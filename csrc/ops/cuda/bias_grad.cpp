// CUDA registration of linear_bias_grad: two launches on the current stream, no host
// synchronization, so it is CUDA-graph capturable.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/bias_grad.h"

namespace mixprec::detail {
namespace {

const BiasGradRunner kRunner{kernels::bias_grad_cuda_splits, [](const kernels::BiasGradParams& p) {
                               kernels::bias_grad_cuda(p, at::cuda::getCurrentCUDAStream().stream());
                             }};

at::Tensor linear_bias_grad_cuda(const at::Tensor& grad) { return linear_bias_grad_impl(grad, kRunner); }

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("linear_bias_grad", &linear_bias_grad_cuda); }

}  // namespace mixprec::detail
