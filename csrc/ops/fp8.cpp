// Validation and packing for the FP8 ops (see fp8.h); the kernels run per backend.
#include "ops/fp8.h"

#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

// x for the cast ops: a contiguous float32/float16/bfloat16 tensor (any number of dimensions;
// the kernels see it as [rows, cols] with cols its last dimension, and a 0-dim tensor as [1, 1]).
kernels::Fp8QuantizeParams pack_x(const char* op, const at::Tensor& x) {
  const std::string what = arg_name(op, "x");
  MIXPREC_CHECK(x.defined(), what, " is undefined");
  kernels::Fp8QuantizeParams p;
  p.x_dtype = kernel_dtype(x, what);
  MIXPREC_CHECK_VALUE(x.is_contiguous(), what, " must be contiguous (got strides ", shape(x.strides()), " for shape ",
                      shape(x.sizes()), "); call .contiguous() first");
  p.cols = x.dim() == 0 ? 1 : x.size(-1);
  p.rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) p.rows *= x.size(d);
  return p;
}

// amax is written while x is read: the same memory for both would race on CUDA.
// Fake tensors (real == false) have no memory to compare.
void check_amax(const char* op, const at::Tensor& amax, const at::Tensor& x, bool real) {
  check_scalar_tensor(op, "amax", amax, x.device());
  MIXPREC_CHECK_VALUE(!real || x.numel() == 0 || at::get_overlap_status(amax, x) == at::MemOverlapStatus::No,
                      arg_name(op, "amax"), " shares memory with x");
}

}  // namespace

kernels::Fp8Format fp8_format_of(const char* op, const char* arg, at::ScalarType dtype) {
  if (dtype == at::ScalarType::Float8_e4m3fn) return kernels::Fp8Format::kE4M3;
  if (dtype == at::ScalarType::Float8_e5m2) return kernels::Fp8Format::kE5M2;
  MIXPREC_CHECK_TYPE(false, arg_name(op, arg), " is ", dtype, "; expected torch.float8_e4m3fn or torch.float8_e5m2");
  return kernels::Fp8Format::kE4M3;  // unreachable
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_impl(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                                                     bool transpose, const std::optional<at::Tensor>& amax,
                                                     Fp8QuantizeRunner run) {
  constexpr const char* kOp = "fp8_quantize";
  kernels::Fp8QuantizeParams p = pack_x(kOp, x);
  p.format = fp8_format_of(kOp, "dtype", dtype);
  check_scalar_tensor(kOp, "scale", scale, x.device());
  if (amax) check_amax(kOp, *amax, x, run != nullptr);
  MIXPREC_CHECK_VALUE(!transpose || x.dim() == 2, arg_name(kOp, "x"), " must be 2-D with transpose=True, got shape ",
                      shape(x.sizes()));

  const auto opts = x.options().dtype(dtype);
  at::Tensor out = at::empty(x.sizes(), opts);
  at::Tensor out_t = transpose ? at::empty({p.cols, p.rows}, opts) : at::empty({0}, opts);
  if (run == nullptr || x.numel() == 0) return {out, out_t};
  p.x = x.const_data_ptr();
  p.out = static_cast<uint8_t*>(out.data_ptr());
  p.out_t = transpose ? static_cast<uint8_t*>(out_t.data_ptr()) : nullptr;
  p.scale = scale.const_data_ptr<float>();
  p.amax = amax ? amax->data_ptr<float>() : nullptr;
  const c10::DeviceGuard guard(x.device());
  run(p);
  return {out, out_t};
}

void fp8_amax_impl(const at::Tensor& x, const at::Tensor& amax, Fp8QuantizeRunner run) {
  constexpr const char* kOp = "fp8_amax_";
  kernels::Fp8QuantizeParams p = pack_x(kOp, x);
  check_amax(kOp, amax, x, run != nullptr);
  if (run == nullptr || x.numel() == 0) return;
  p.x = x.const_data_ptr();
  p.amax = amax.data_ptr<float>();
  const c10::DeviceGuard guard(x.device());
  run(p);
}

void fp8_update_scale_impl(const at::Tensor& scale, const at::Tensor& amax_history, const at::Tensor& amax,
                           at::ScalarType dtype, double margin, c10::string_view reduction, Fp8ScaleRunner run) {
  constexpr const char* kOp = "fp8_update_scale_";
  const at::Device device = scale.device();
  check_scalar_tensor(kOp, "scale", scale, device);
  check_scalar_tensor(kOp, "amax", amax, device);
  const std::string hist = arg_name(kOp, "amax_history");
  MIXPREC_CHECK(amax_history.defined(), hist, " is undefined");
  MIXPREC_CHECK(amax_history.device() == device, hist, " is on ", amax_history.device().str(), " but the op runs on ",
                device.str());
  MIXPREC_CHECK_TYPE(amax_history.scalar_type() == at::kFloat, hist, " has dtype ", amax_history.scalar_type(),
                     "; expected float32");
  // Fake tensors may give the history a symbolic length: its value is checked by the real kernels.
  MIXPREC_CHECK_VALUE(
      amax_history.dim() == 1 && (run == nullptr || amax_history.numel() >= 1) && amax_history.is_contiguous(), hist,
      " must be a contiguous float32 vector of length >= 1, got shape ", shape(amax_history.sym_sizes()));
  const kernels::Fp8Format format = fp8_format_of(kOp, "dtype", dtype);
  MIXPREC_CHECK_VALUE(std::isfinite(margin) && margin >= 0 && margin <= 64, arg_name(kOp, "margin"),
                      " must be a finite number in [0, 64] (the scale is divided by 2^margin), got ", num(margin));
  MIXPREC_CHECK_VALUE(reduction == "max" || reduction == "most_recent", arg_name(kOp, "reduction"),
                      " must be 'max' or 'most_recent', got '", std::string(reduction), "'");
  if (run != nullptr) {
    // The kernel pushes amax into the history and resets it: the three must be distinct memory.
    for (const auto& [a, b, name] : {std::make_tuple(&amax, &amax_history, "amax and amax_history"),
                                     std::make_tuple(&scale, &amax_history, "scale and amax_history"),
                                     std::make_tuple(&scale, &amax, "scale and amax")})
      MIXPREC_CHECK_VALUE(at::get_overlap_status(*a, *b) == at::MemOverlapStatus::No, "mixprec::", kOp, ": ", name,
                          " share memory");
  }
  if (run == nullptr) return;
  kernels::Fp8ScaleParams p;
  p.scale = scale.data_ptr<float>();
  p.history = amax_history.data_ptr<float>();
  p.history_len = amax_history.numel();
  p.amax = amax.data_ptr<float>();
  p.fp8_max = format == kernels::Fp8Format::kE4M3 ? kernels::kFp8E4M3Max : kernels::kFp8E5M2Max;
  p.margin_factor = std::exp2(-margin);
  p.reduce_max = reduction == "max";
  const c10::DeviceGuard guard(device);
  run(p);
}

}  // namespace mixprec::detail
