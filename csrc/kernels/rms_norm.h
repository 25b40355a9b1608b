// Torch-free entry points of RMSNorm over the last dimension (Zhang & Sennrich 2019; torch's
// F.rms_norm, Apex's FusedRMSNorm): the forward (output, and each row's reciprocal RMS in fp32)
// and the backward (input gradient, and the weight gradient as a deterministic column sum).
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// The same kernels as LayerNorm's (kernels/layer_norm.h) without the mean: one warp per row on
// CUDA, the row held in registers across its passes (kernels/row_norm.cuh), the weight gradient's
// column sums per warp in shared memory, then per block, then column_sum.cuh in split order.
//
// The math, per row of C values x with r = 1 / sqrt(sum(x^2) / C + eps), all in fp32:
//   forward:  y = x * r * w                                (w = 1 where absent)
//   backward: xhat = x * r,  g = dy * w,
//             dx = r * (g - xhat * mean(g * xhat)),
//             dw = sum over rows of dy * xhat.
// The weight may be fp32 while the input is fp16/bf16 (Apex's MixedFusedRMSNorm keeps an fp32
// weight for O2 models): out and dx take the input's dtype, dw the weight's.

struct RmsNormForwardParams {
  DType dtype = DType::kFloat32;         // of input and out
  DType weight_dtype = DType::kFloat32;  // input's dtype or float32
  const void* input = nullptr;           // [rows, cols], contiguous
  const void* weight = nullptr;          // [cols] or null
  int64_t rows = 0;
  int64_t cols = 0;
  float eps = 1e-5f;
  void* out = nullptr;    // [rows, cols]
  float* rstd = nullptr;  // [rows]
};

struct RmsNormBackwardParams {
  DType dtype = DType::kFloat32;         // of grad_out, input and grad_input
  DType weight_dtype = DType::kFloat32;  // of weight and grad_weight
  const void* grad_out = nullptr;        // [rows, cols], contiguous
  const void* input = nullptr;           // [rows, cols], contiguous
  const float* rstd = nullptr;           // [rows], from the forward
  const void* weight = nullptr;          // [cols] or null
  int64_t rows = 0;
  int64_t cols = 0;
  void* grad_input = nullptr;   // [rows, cols], or null when not wanted
  void* grad_weight = nullptr;  // [cols], or null when not wanted
  int64_t splits = 1;           // row splits of the weight gradient (rms_norm_cuda_splits / cpu_row_splits)
  float* partials = nullptr;    // fp32 scratch [splits, cols]; null when grad_weight is not wanted
};

// CPU: rows split in fixed blocks (cpu_row_splits), so the weight gradient does not depend on the
// thread count. The ops tier spreads the calls over its thread pool.
void rms_norm_forward_cpu(const RmsNormForwardParams& p, int64_t row_begin, int64_t row_end);
// The input gradient of the split's rows and the split's row of partials.
void rms_norm_backward_cpu(const RmsNormBackwardParams& p, int64_t split_begin, int64_t split_end);
// The weight gradient of columns [col_begin, col_end) from the partials.
void rms_norm_weight_grad_finish_cpu(const RmsNormBackwardParams& p, int64_t col_begin, int64_t col_end);

// CUDA: the widest row the backward's shared memory holds (a warp keeps 1 fp32 value per
// column, half of LayerNorm's 2), the splits the backward wants for a shape, the launches.
constexpr int64_t kRmsNormMaxCudaCols = 24576;
int64_t rms_norm_cuda_splits(DType dtype, int64_t rows, int64_t cols);
void rms_norm_forward_cuda(const RmsNormForwardParams& p, Stream stream);
void rms_norm_backward_cuda(const RmsNormBackwardParams& p, Stream stream);

}  // namespace mixprec::kernels
