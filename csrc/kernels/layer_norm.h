// Torch-free entry points of LayerNorm over the last dimension: the forward (output, and each
// row's mean and reciprocal standard deviation in fp32) and the backward (input gradient, and the
// weight and bias gradients as column sums), all arithmetic in fp32.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// Why kernels of our own: on GPT-2's shapes torch's LayerNorm forward plus backward runs at 20-28%
// of the H200's copy bandwidth (145 us for a 16384 x 768 fp16 layer; 3.6 ms of a 42 ms O2 step on
// GPT-2 small, 3.2 ms on large: benchmarks/layer_kernels.py). Here one warp owns a row: its
// statistics are warp reductions, HBM is read once (a row's later passes use it from registers
// or, past 8 strides, from the cache), and the backward's weight and bias sums are accumulated
// per warp in shared memory while the input gradient is computed, then reduced like
// linear_bias_grad's partials.
// Measured on an H200 (benchmarks/RESULTS.md): forward 47-57% of copy (torch 30%); forward plus
// backward 59 us against torch's 144 on 16384 x 768 and 34.7 against 43.6 on 4096 x 1280, where
// each warp gets two rows and the backward (20 us for 31 MB) is latency-bound: ncu counts 15
// warps an SM (registers and shared memory allow 16) and 0.66 eligible per scheduler.
//
// The math, per row of C values x with mean m and rstd r = 1 / sqrt(var + eps) (the biased
// variance, two-pass: sum((x - m)^2) / C):
//   forward:  y = (x - m) * r * w + b                     (w = 1, b = 0 where absent)
//   backward: xhat = (x - m) * r,  g = dy * w,
//             dx = r * (g - mean(g) - xhat * mean(g * xhat)),
//             dw = sum over rows of dy * xhat,  db = sum over rows of dy.
// The sums over rows are deterministic: fixed row splits, fp32 partials added in a fixed order.

struct LayerNormForwardParams {
  DType dtype = DType::kFloat32;  // of input, weight, bias and out
  const void* input = nullptr;    // [rows, cols], contiguous
  const void* weight = nullptr;   // [cols] or null
  const void* bias = nullptr;     // [cols] or null
  int64_t rows = 0;
  int64_t cols = 0;
  float eps = 1e-5f;
  void* out = nullptr;    // [rows, cols]
  float* mean = nullptr;  // [rows]
  float* rstd = nullptr;  // [rows]
};

struct LayerNormBackwardParams {
  DType dtype = DType::kFloat32;   // of grad_out, input, weight and the gradients
  const void* grad_out = nullptr;  // [rows, cols], contiguous
  const void* input = nullptr;     // [rows, cols], contiguous
  const float* mean = nullptr;     // [rows], from the forward
  const float* rstd = nullptr;     // [rows], from the forward
  const void* weight = nullptr;    // [cols] or null
  int64_t rows = 0;
  int64_t cols = 0;
  void* grad_input = nullptr;   // [rows, cols], or null when not wanted
  void* grad_weight = nullptr;  // [cols], or null when not wanted
  void* grad_bias = nullptr;    // [cols], or null when not wanted
  int64_t splits = 1;           // row splits of the parameter gradients (the *_splits functions)
  float* partials = nullptr;    // fp32 scratch [2, splits, cols] (weight's, then bias's); null
                                // when neither parameter gradient is wanted
};

// CPU: rows split in fixed blocks (cpu_row_splits), so the parameter gradients do not
// depend on the thread count. The ops tier spreads the calls over its thread pool.
void layer_norm_forward_cpu(const LayerNormForwardParams& p, int64_t row_begin, int64_t row_end);
// The input gradient of the split's rows and the split's rows of partials.
void layer_norm_backward_cpu(const LayerNormBackwardParams& p, int64_t split_begin, int64_t split_end);
// The parameter gradients of columns [col_begin, col_end) from the partials.
void layer_norm_param_grads_finish_cpu(const LayerNormBackwardParams& p, int64_t col_begin, int64_t col_end);

// CUDA: the widest row the backward's shared memory holds (a warp keeps 2 fp32 values per
// column), the splits the backward wants for a shape, and the launches on `stream`.
constexpr int64_t kLayerNormMaxCudaCols = 12288;
int64_t layer_norm_cuda_splits(DType dtype, int64_t rows, int64_t cols);
void layer_norm_forward_cuda(const LayerNormForwardParams& p, Stream stream);
void layer_norm_backward_cuda(const LayerNormBackwardParams& p, Stream stream);

}  // namespace mixprec::kernels
