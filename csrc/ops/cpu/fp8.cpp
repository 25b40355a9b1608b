// CPU registration of the FP8 ops: spans (or tiles of rows, with the transpose) spread over
// ATen's thread pool, the per-thread amax combined once and folded into the amax scalar.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/fp8.h"

namespace mixprec::detail {
namespace {

constexpr int64_t kGrainElems = 65536;

void run_quantize(const kernels::Fp8QuantizeParams& p) {
  uint32_t worst;
  const auto combine = [](uint32_t a, uint32_t b) { return a > b ? a : b; };
  if (p.out_t != nullptr) {
    const int64_t tiles = (p.rows + kernels::kFp8CpuTileRows - 1) / kernels::kFp8CpuTileRows;
    const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, p.cols * kernels::kFp8CpuTileRows));
    worst = at::parallel_reduce(
        0, tiles, grain, uint32_t{0},
        [&](int64_t b, int64_t e, uint32_t) { return kernels::fp8_quantize_tiles_cpu(p, b, e); }, combine);
  } else {
    worst = at::parallel_reduce(
        0, p.rows * p.cols, kGrainElems, uint32_t{0},
        [&](int64_t b, int64_t e, uint32_t) { return kernels::fp8_quantize_span_cpu(p, b, e); }, combine);
  }
  if (p.amax != nullptr) *p.amax = kernels::bits_float(combine(kernels::fp8_abs_bits(*p.amax), worst));
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                                                    bool transpose, const std::optional<at::Tensor>& amax) {
  return fp8_quantize_impl(x, scale, dtype, transpose, amax, run_quantize);
}

void fp8_amax_cpu(const at::Tensor& x, const at::Tensor& amax) { fp8_amax_impl(x, amax, run_quantize); }

void fp8_update_scale_cpu(const at::Tensor& scale, const at::Tensor& amax_history, const at::Tensor& amax,
                          at::ScalarType dtype, double margin, c10::string_view reduction) {
  fp8_update_scale_impl(scale, amax_history, amax, dtype, margin, reduction, kernels::fp8_update_scale_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) {
  m.impl("fp8_quantize", &fp8_quantize_cpu);
  m.impl("fp8_amax_", &fp8_amax_cpu);
  m.impl("fp8_update_scale_", &fp8_update_scale_cpu);
}

}  // namespace mixprec::detail
