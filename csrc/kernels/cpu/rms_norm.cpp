// CPU kernels of RMSNorm (kernels/rms_norm.h): each row converted once to an fp32 buffer; its
// sums run in 16 independent lanes so that the loops vectorize (AVX2 clone on x86-64); the
// backward adds its rows' dy * xhat into its split's row of partials in row order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/row_norm.h"
#include "kernels/rms_norm.h"

namespace mixprec::kernels {
namespace {

constexpr int kLanes = 16;  // two AVX2 registers of partial sums, as kernels/cpu/norm.cpp

// sum(a * b) in kLanes partial sums added in lane order: a fixed order for a given n.
MIXPREC_CPU_CLONES float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

MIXPREC_CPU_CLONES void normalize_row(float* x, const float* w, float rstd, int64_t n) {
  for (int64_t c = 0; c < n; ++c) x[c] = x[c] * rstd * w[c];
}

// One row's backward: x becomes xhat, then dx (into x); acc (null: no weight gradient) += dy * xhat.
MIXPREC_CPU_CLONES void backward_row(float* x, const float* dy, const float* w, float* g, float rstd, float* acc,
                                     int64_t n, bool want_dx) {
  for (int64_t c = 0; c < n; ++c) {
    x[c] *= rstd;
    g[c] = dy[c] * w[c];
  }
  if (acc != nullptr)
    for (int64_t c = 0; c < n; ++c) acc[c] += dy[c] * x[c];
  if (!want_dx) return;
  const float mean_gx = dot(g, x, n) / static_cast<float>(n);
  for (int64_t c = 0; c < n; ++c) x[c] = rstd * (g[c] - x[c] * mean_gx);
}

// Calls f(input tag, weight tag) for the kernel's two dtypes.
template <class F> void with_dtypes(DType input, DType weight, F&& f) {
  cpu::with_dtype(input, [&](auto d) { cpu::with_dtype(weight, [&](auto dw) { f(d, dw); }); });
}

}  // namespace

void rms_norm_forward_cpu(const RmsNormForwardParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t n = p.cols;
  std::vector<float> x(static_cast<size_t>(n)), w(static_cast<size_t>(n), 1.f);
  with_dtypes(p.dtype, p.weight_dtype, [&](auto d, auto dw) {
    constexpr DType D = decltype(d)::value;
    if (p.weight != nullptr) cpu::load_tile_as<decltype(dw)::value>(p.weight, n, w.data());
    for (int64_t r = row_begin; r < row_end; ++r) {
      cpu::load_tile_as<D>(cpu::row_of<D>(p.input, r, n), n, x.data());
      const float rstd = 1.f / std::sqrt(dot(x.data(), x.data(), n) / static_cast<float>(n) + p.eps);
      normalize_row(x.data(), w.data(), rstd, n);
      cpu::store_tile_as<D>(x.data(), n, cpu::row_of<D>(p.out, r, n));
      p.rstd[r] = rstd;
    }
  });
}

void rms_norm_backward_cpu(const RmsNormBackwardParams& p, int64_t split_begin, int64_t split_end) {
  const int64_t n = p.cols;
  const int64_t per_split = (p.rows + p.splits - 1) / p.splits;
  std::vector<float> x(static_cast<size_t>(n)), dy(static_cast<size_t>(n)), g(static_cast<size_t>(n)),
      w(static_cast<size_t>(n), 1.f);
  with_dtypes(p.dtype, p.weight_dtype, [&](auto d, auto dw) {
    constexpr DType D = decltype(d)::value;
    if (p.weight != nullptr) cpu::load_tile_as<decltype(dw)::value>(p.weight, n, w.data());
    for (int64_t s = split_begin; s < split_end; ++s) {
      float* acc = p.partials != nullptr ? p.partials + s * n : nullptr;
      if (acc != nullptr) std::fill(acc, acc + n, 0.f);
      const int64_t end = std::min(p.rows, (s + 1) * per_split);
      for (int64_t r = s * per_split; r < end; ++r) {
        cpu::load_tile_as<D>(cpu::row_of<D>(p.input, r, n), n, x.data());
        cpu::load_tile_as<D>(cpu::row_of<D>(p.grad_out, r, n), n, dy.data());
        backward_row(x.data(), dy.data(), w.data(), g.data(), p.rstd[r], acc, n, p.grad_input != nullptr);
        if (p.grad_input != nullptr) cpu::store_tile_as<D>(x.data(), n, cpu::row_of<D>(p.grad_input, r, n));
      }
    }
  });
}

void rms_norm_weight_grad_finish_cpu(const RmsNormBackwardParams& p, int64_t col_begin, int64_t col_end) {
  cpu::with_dtype(p.weight_dtype, [&](auto dw) {
    cpu::finish_column_sums<decltype(dw)::value>(p.partials, p.splits, p.cols, p.grad_weight, col_begin, col_end);
  });
}

}  // namespace mixprec::kernels
