// Meta registrations of the FP8 ops for torch.compile's fake tensors: the same checks and output
// shapes as the real ops, no kernel.
#include <torch/library.h>

#include "ops/fp8.h"

namespace mixprec::detail {
namespace {

std::tuple<at::Tensor, at::Tensor> fp8_quantize_meta(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                                                     bool transpose, const std::optional<at::Tensor>& amax) {
  return fp8_quantize_impl(x, scale, dtype, transpose, amax, nullptr);
}

void fp8_amax_meta(const at::Tensor& x, const at::Tensor& amax) { fp8_amax_impl(x, amax, nullptr); }

void fp8_update_scale_meta(const at::Tensor& scale, const at::Tensor& amax_history, const at::Tensor& amax,
                           at::ScalarType dtype, double margin, c10::string_view reduction) {
  fp8_update_scale_impl(scale, amax_history, amax, dtype, margin, reduction, nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) {
  m.impl("fp8_quantize", &fp8_quantize_meta);
  m.impl("fp8_amax_", &fp8_amax_meta);
  m.impl("fp8_update_scale_", &fp8_update_scale_meta);
  m.impl("fp8_linear", &fp8_linear_meta);
}

}  // namespace mixprec::detail
