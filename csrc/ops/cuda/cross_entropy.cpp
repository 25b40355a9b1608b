// CUDA registration of cross_entropy_forward / cross_entropy_backward: one launch each on the
// current stream, no host synchronization (targets out of range poison their row, see
// kernels/cross_entropy.h), so both are CUDA-graph capturable.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/cross_entropy.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

const CrossEntropyRunners kRunners{
    [](const kernels::CrossEntropyForwardParams& p) { kernels::cross_entropy_forward_cuda(p, current_stream()); },
    [](const kernels::CrossEntropyBackwardParams& p) { kernels::cross_entropy_backward_cuda(p, current_stream()); },
    /*check_target_values=*/false};

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_cuda(const at::Tensor& logits, const at::Tensor& target,
                                                              int64_t ignore_index) {
  return cross_entropy_forward_impl(logits, target, ignore_index, kRunners);
}

at::Tensor cross_entropy_backward_cuda(const at::Tensor& grad_losses, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index) {
  return cross_entropy_backward_impl(grad_losses, logits, target, lse, ignore_index, kRunners);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) {
  m.impl("cross_entropy_forward", &cross_entropy_forward_cuda);
  m.impl("cross_entropy_backward", &cross_entropy_backward_cuda);
}

}  // namespace mixprec::detail
