// CPU kernels of the bias gradient (kernels/bias_grad.h): each split sums its rows in order into
// an fp32 row of partials, column-contiguous so the inner loop vectorizes; then each column's
// partials are added in split order and rounded once.
#include <algorithm>
#include <vector>

#include "kernels/bias_grad.h"
#include "kernels/cpu/convert.h"

namespace mixprec::kernels {

void bias_grad_partials_cpu(const BiasGradParams& p, int64_t split_begin, int64_t split_end) {
  const int64_t per_split = (p.rows + p.splits - 1) / p.splits;
  std::vector<float> row(static_cast<size_t>(p.cols));
  cpu::with_dtype(p.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    for (int64_t s = split_begin; s < split_end; ++s) {
      float* acc = p.partials + s * p.cols;
      for (int64_t c = 0; c < p.cols; ++c) acc[c] = 0.f;
      const int64_t end = std::min(p.rows, (s + 1) * per_split);
      for (int64_t r = s * per_split; r < end; ++r) {
        const char* src = static_cast<const char*>(p.grad) + r * p.cols * cpu::element_size(D);
        cpu::load_tile_as<D>(src, p.cols, row.data());
        for (int64_t c = 0; c < p.cols; ++c) acc[c] += row[c];
      }
    }
  });
}

void bias_grad_finish_cpu(const BiasGradParams& p, int64_t col_begin, int64_t col_end) {
  cpu::with_dtype(p.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    for (int64_t c = col_begin; c < col_end; ++c) {
      float sum = 0.f;
      for (int64_t s = 0; s < p.splits; ++s) sum += p.partials[s * p.cols + c];
      cpu::store_one<D>(p.out, c, sum);
    }
  });
}

}  // namespace mixprec::kernels
