// CUDA registration of rms_norm_forward / rms_norm_backward: one launch forward, two backward
// (the second finishes the weight gradient's partials), on the current stream with no host
// synchronization, so both are CUDA-graph capturable.
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include "ops/rms_norm.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

const RmsNormRunners kRunners{
    [](const kernels::RmsNormForwardParams& p) { kernels::rms_norm_forward_cuda(p, current_stream()); },
    kernels::rms_norm_cuda_splits,
    [](const kernels::RmsNormBackwardParams& p) { kernels::rms_norm_backward_cuda(p, current_stream()); }};

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                                                          at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                          const std::optional<at::Tensor>& weight,
                                                          std::array<bool, 2> output_mask) {
  // The backward keeps one fp32 row per warp in shared memory (kernels/rms_norm.h).
  MIXPREC_CHECK_VALUE(c10::multiply_integers(normalized_shape) <= kernels::kRmsNormMaxCudaCols,
                      arg_name("rms_norm_backward", "normalized_shape"), " ", shape(normalized_shape),
                      "; on CUDA the normalized size must be at most ", num(kernels::kRmsNormMaxCudaCols),
                      " (mixprec.rms_norm uses torch's RMSNorm beyond it)");
  return rms_norm_backward_impl(grad_out, input, normalized_shape, rstd, weight, output_mask, kRunners);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_with<kRunners>);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
}

}  // namespace mixprec::detail
