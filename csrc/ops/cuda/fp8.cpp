// CUDA registration of the FP8 ops: kernels launched on the current stream, no host sync (the
// amax and the scale stay on the device).
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/fp8.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void run_quantize(const kernels::Fp8QuantizeParams& p) { kernels::fp8_quantize_cuda(p, current_stream()); }

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                                                     bool transpose, const std::optional<at::Tensor>& amax) {
  return fp8_quantize_impl(x, scale, dtype, transpose, amax, run_quantize);
}

void fp8_amax_cuda(const at::Tensor& x, const at::Tensor& amax) { fp8_amax_impl(x, amax, run_quantize); }

void fp8_update_scale_cuda(const at::Tensor& scale, const at::Tensor& amax_history, const at::Tensor& amax,
                           at::ScalarType dtype, double margin, c10::string_view reduction) {
  fp8_update_scale_impl(scale, amax_history, amax, dtype, margin, reduction,
                        [](const kernels::Fp8ScaleParams& p) { kernels::fp8_update_scale_cuda(p, current_stream()); });
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) {
  m.impl("fp8_quantize", &fp8_quantize_cuda);
  m.impl("fp8_amax_", &fp8_amax_cuda);
  m.impl("fp8_update_scale_", &fp8_update_scale_cuda);
}

}  // namespace mixprec::detail
