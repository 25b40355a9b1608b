// CPU kernels of LayerNorm (kernels/layer_norm.h): each row converted once to an fp32 buffer, its
// statistics in two passes over it; the backward adds its rows' dy * xhat and dy into its split's
// row of partials in row order, and the finish adds a column's partials in split order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/row_norm.h"
#include "kernels/layer_norm.h"

namespace mixprec::kernels {

void layer_norm_forward_cpu(const LayerNormForwardParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t n = p.cols;
  std::vector<float> x(static_cast<size_t>(n)), w(static_cast<size_t>(n), 1.f), b(static_cast<size_t>(n), 0.f);
  cpu::with_dtype(p.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (p.weight != nullptr) cpu::load_tile_as<D>(p.weight, n, w.data());
    if (p.bias != nullptr) cpu::load_tile_as<D>(p.bias, n, b.data());
    for (int64_t r = row_begin; r < row_end; ++r) {
      cpu::load_tile_as<D>(cpu::row_of<D>(p.input, r, n), n, x.data());
      float sum = 0.f;
      for (int64_t c = 0; c < n; ++c) sum += x[c];
      const float mean = sum / static_cast<float>(n);
      float squares = 0.f;
      for (int64_t c = 0; c < n; ++c) squares += (x[c] - mean) * (x[c] - mean);
      const float rstd = 1.f / std::sqrt(squares / static_cast<float>(n) + p.eps);
      for (int64_t c = 0; c < n; ++c) x[c] = (x[c] - mean) * rstd * w[c] + b[c];
      cpu::store_tile_as<D>(x.data(), n, cpu::row_of<D>(p.out, r, n));
      p.mean[r] = mean;
      p.rstd[r] = rstd;
    }
  });
}

void layer_norm_backward_cpu(const LayerNormBackwardParams& p, int64_t split_begin, int64_t split_end) {
  const int64_t n = p.cols;
  const int64_t per_split = (p.rows + p.splits - 1) / p.splits;
  std::vector<float> x(static_cast<size_t>(n)), dy(static_cast<size_t>(n)), w(static_cast<size_t>(n), 1.f);
  cpu::with_dtype(p.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (p.weight != nullptr) cpu::load_tile_as<D>(p.weight, n, w.data());
    for (int64_t s = split_begin; s < split_end; ++s) {
      float* acc_w = p.partials != nullptr ? p.partials + s * n : nullptr;
      float* acc_b = p.partials != nullptr ? p.partials + (p.splits + s) * n : nullptr;
      if (acc_w != nullptr) std::fill(acc_w, acc_w + n, 0.f), std::fill(acc_b, acc_b + n, 0.f);
      const int64_t end = std::min(p.rows, (s + 1) * per_split);
      for (int64_t r = s * per_split; r < end; ++r) {
        cpu::load_tile_as<D>(cpu::row_of<D>(p.input, r, n), n, x.data());
        cpu::load_tile_as<D>(cpu::row_of<D>(p.grad_out, r, n), n, dy.data());
        const float mean = p.mean[r], rstd = p.rstd[r];
        float sum_g = 0.f, sum_gx = 0.f;
        for (int64_t c = 0; c < n; ++c) {
          const float xhat = (x[c] - mean) * rstd;
          const float g = dy[c] * w[c];
          sum_g += g;
          sum_gx += g * xhat;
          if (acc_w != nullptr) {
            acc_w[c] += dy[c] * xhat;
            acc_b[c] += dy[c];
          }
          x[c] = xhat;  // kept for the input gradient below
        }
        if (p.grad_input == nullptr) continue;
        const float mean_g = sum_g / static_cast<float>(n), mean_gx = sum_gx / static_cast<float>(n);
        for (int64_t c = 0; c < n; ++c) x[c] = rstd * (dy[c] * w[c] - mean_g - x[c] * mean_gx);
        cpu::store_tile_as<D>(x.data(), n, cpu::row_of<D>(p.grad_input, r, n));
      }
    }
  });
}

void layer_norm_param_grads_finish_cpu(const LayerNormBackwardParams& p, int64_t col_begin, int64_t col_end) {
  cpu::with_dtype(p.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    void* outs[2] = {p.grad_weight, p.grad_bias};
    for (int set = 0; set < 2; ++set) {
      if (outs[set] != nullptr)
        cpu::finish_column_sums<D>(p.partials + set * p.splits * p.cols, p.splits, p.cols, outs[set], col_begin,
                                   col_end);
    }
  });
}

}  // namespace mixprec::kernels
