// CUDA registration of layer_norm_forward / layer_norm_backward: one launch forward, two backward
// (the second adds the parameter gradients' partials), on the current stream with no host
// synchronization, so both are CUDA-graph capturable.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/layer_norm.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

const LayerNormRunners kRunners{
    [](const kernels::LayerNormForwardParams& p) { kernels::layer_norm_forward_cuda(p, current_stream()); },
    kernels::layer_norm_cuda_splits,
    [](const kernels::LayerNormBackwardParams& p) { kernels::layer_norm_backward_cuda(p, current_stream()); }};

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(const at::Tensor& grad_out,
                                                                        const at::Tensor& input, const at::Tensor& mean,
                                                                        const at::Tensor& rstd,
                                                                        const std::optional<at::Tensor>& weight,
                                                                        std::array<bool, 3> output_mask) {
  // The backward keeps two fp32 rows per warp in shared memory (kernels/layer_norm.h).
  MIXPREC_CHECK_VALUE(!input.defined() || input.dim() != 2 || input.size(1) <= kernels::kLayerNormMaxCudaCols,
                      arg_name("layer_norm_backward", "input"), " has shape ", shape(input.sizes()),
                      "; on CUDA the normalized size must be at most ", num(kernels::kLayerNormMaxCudaCols),
                      " (mixprec.layer_norm uses torch's LayerNorm beyond it)");
  return layer_norm_backward_impl(grad_out, input, mean, rstd, weight, output_mask, kRunners);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_with<kRunners>);
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
}

}  // namespace mixprec::detail
