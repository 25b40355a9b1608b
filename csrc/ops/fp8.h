// Ops-tier implementation of the FP8 family (fp8_quantize, fp8_amax_, fp8_update_scale_), shared
// by the CPU, CUDA and Meta registrations: validation and output allocation live here once.
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

}  // namespace mixprec::detail
