// CUDA registration of multi_tensor_norm: partials and finalize on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/norm.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cuda(at::TensorList tensors, double ord, bool per_tensor) {
  return multi_tensor_norm_impl(
      tensors, ord, per_tensor,
      {[](const kernels::NormParams& p) { kernels::norm_partials_cuda(p, current_stream()); },
       [](const kernels::NormFinalizeParams& p) { kernels::norm_finalize_cuda(p, current_stream()); }});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("multi_tensor_norm", &multi_tensor_norm_cuda); }

}  // namespace mixprec::detail
