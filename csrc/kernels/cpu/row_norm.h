// CPU pieces shared by the row norms (LayerNorm, RMSNorm): a row's address, and the finish of a
// deterministic column sum over the fixed row splits' fp32 partials.
#pragma once

#include <cstdint>

#include "kernels/cpu/convert.h"

namespace mixprec::kernels::cpu {

// Row r of a contiguous [rows, cols] tensor of dtype D.
template <DType D> MIXPREC_INLINE const void* row_of(const void* base, int64_t r, int64_t cols) {
  return static_cast<const char*>(base) + r * cols * element_size(D);
}
template <DType D> MIXPREC_INLINE void* row_of(void* base, int64_t r, int64_t cols) {
  return static_cast<char*>(base) + r * cols * element_size(D);
}

// Columns [col_begin, col_end) of partials [splits, cols] added in split order in fp32 and
// rounded once into out (dtype D): the same sum whatever the thread count.
template <DType D>
MIXPREC_INLINE void finish_column_sums(const float* partials, int64_t splits, int64_t cols, void* out,
                                       int64_t col_begin, int64_t col_end) {
  for (int64_t c = col_begin; c < col_end; ++c) {
    float sum = 0.f;
    for (int64_t s = 0; s < splits; ++s) sum += partials[s * cols + c];
    store_one<D>(out, c, sum);
  }
}

}  // namespace mixprec::kernels::cpu
