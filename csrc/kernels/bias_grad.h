// Torch-free entry points of the bias gradient of a Linear layer: the output gradient [rows, cols]
// summed over its rows, in fp32, in a fixed order (deterministic), rounded once to its dtype.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// Why a kernel of its own: torch computes a Linear's bias gradient as grad.sum(0), a reduction
// across rows that its generic reduction kernel runs at about a third of the copy bandwidth on
// GPT-2's shapes (H200: 2.4 ms a step for 145 such sums on GPT-2 large, where 0.8 ms would move
// their bytes). Here every element is read once with 16-byte loads, and the rows are split among
// enough blocks to fill the GPU.
//
// Two passes keep the result independent of timing: pass 1 writes one fp32 partial sum per
// (row split, column) into `partials`; pass 2 adds a column's partials in a fixed order (split
// order on the CPU; on CUDA every g-th split in order for g = 8 or 32 row groups, then those g
// sums in order).

struct BiasGradParams {
  DType dtype = DType::kFloat32;  // of grad and out
  const void* grad = nullptr;     // [rows, cols], contiguous
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t splits = 1;         // row splits: partials holds [splits, cols]
  float* partials = nullptr;  // fp32 scratch, [splits, cols]
  void* out = nullptr;        // [cols], grad's dtype
};

// CPU pass 1 for splits [split_begin, split_end), every column; pass 2 for columns
// [col_begin, col_end). The ops tier spreads both over its thread pool.
void bias_grad_partials_cpu(const BiasGradParams& p, int64_t split_begin, int64_t split_end);
void bias_grad_finish_cpu(const BiasGradParams& p, int64_t col_begin, int64_t col_end);

// The row splits the CUDA kernel wants for this shape (the ops tier sizes `partials` with it),
// and both passes on `stream`.
int64_t bias_grad_cuda_splits(DType dtype, int64_t rows, int64_t cols);
void bias_grad_cuda(const BiasGradParams& p, Stream stream);

}  // namespace mixprec::kernels
