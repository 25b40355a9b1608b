// Ops-tier implementation of the FP8 family (fp8_quantize, fp8_amax_, fp8_update_scale_ here;
// fp8_linear and fp8_scaled_mm in fp8_linear.cpp), shared by the CPU, CUDA and Meta registrations:
// validation and output allocation live here once.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "kernels/fp8.h"

namespace mixprec::detail {

using Fp8QuantizeRunner = void (*)(const kernels::Fp8QuantizeParams&);
using Fp8ScaleRunner = void (*)(const kernels::Fp8ScaleParams&);

// The kernel format of an FP8 dtype argument (float8_e4m3fn or float8_e5m2), or an error naming
// op and argument.
kernels::Fp8Format fp8_format_of(const char* op, const char* arg, at::ScalarType dtype);

// Checks every argument (nothing is written before all pass) and allocates (out, out_t) on x's
// device, which may be Meta; out_t is [0] without transpose. run == nullptr: allocate only.
std::tuple<at::Tensor, at::Tensor> fp8_quantize_impl(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                                                     bool transpose, const std::optional<at::Tensor>& amax,
                                                     Fp8QuantizeRunner run);

void fp8_amax_impl(const at::Tensor& x, const at::Tensor& amax, Fp8QuantizeRunner run);

void fp8_update_scale_impl(const at::Tensor& scale, const at::Tensor& amax_history, const at::Tensor& amax,
                           at::ScalarType dtype, double margin, c10::string_view reduction, Fp8ScaleRunner run);

// (a * scale_a) @ (b * scale_b) (+ bias), FP8 a row-major and b column-major, fp32 accumulation,
// one rounding to out_dtype: at::_scaled_mm, or (emulate; default off CUDA) exact widening to fp32.
at::Tensor fp8_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                         at::ScalarType out_dtype, const std::optional<at::Tensor>& bias = std::nullopt,
                         std::optional<bool> emulate = std::nullopt);

// fp8_linear's parameters as each of its kernels takes them (the schema in ops/library.cpp), and
// the same names as arguments: the op has three kernels (autograd, below autograd, Meta).
#define MIXPREC_FP8_LINEAR_PARAMS                                                                                   \
  const at::Tensor &input, const at::Tensor &weight, const std::optional<at::Tensor>&bias, const at::Tensor &scale, \
      const at::Tensor &amax, const at::Tensor &amax_history, at::ScalarType forward_dtype,                         \
      at::ScalarType backward_dtype, bool delayed, double margin, c10::string_view reduction,                       \
      std::optional<c10::string_view> group_name, const std::optional<at::Tensor>&saturation
#define MIXPREC_FP8_LINEAR_ARGS                                                                              \
  input, weight, bias, scale, amax, amax_history, forward_dtype, backward_dtype, delayed, margin, reduction, \
      group_name, saturation

// fp8_linear's Meta kernel: every check of the real op, and the output shape.
at::Tensor fp8_linear_meta(MIXPREC_FP8_LINEAR_PARAMS);

}  // namespace mixprec::detail
