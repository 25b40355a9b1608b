// Torch-free entry points of the fused cross-entropy loss (forward: per-row loss and log-sum-exp;
// backward: the logits' gradient) reading fp32/fp16/bf16 logits directly, all math in fp32.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// Why fused: an fp32 copy of [N, V] low-precision logits, its log_softmax and their backwards
// move ~6x the bytes of the logits themselves; here the forward reads the logits once and the
// backward reads them once and writes the gradient once, in the logits' dtype.
//
// Targets outside [0, vocab) other than ignore_index: the ops tier rejects them on the CPU. On
// CUDA (which must not wait for the host to look) the kernels poison the row instead: its loss
// is NaN (lse is still the row's log-sum-exp) and its gradient row is all NaN, so the step's
// non-finite check (GradScaler, found_inf) skips it rather than training on garbage.

struct CrossEntropyForwardParams {
  DType dtype = DType::kFloat32;
  const void* logits = nullptr;     // [rows, vocab], contiguous
  const int64_t* target = nullptr;  // [rows]
  int64_t rows = 0;
  int64_t vocab = 0;  // >= 1
  int64_t ignore_index = -100;
  float* losses = nullptr;  // [rows]: lse - logit[target], 0 where target == ignore_index
  float* lse = nullptr;     // [rows]: log(sum_j exp(logit_j)), NaN if the row holds a NaN or +inf
};

// Rows [row_begin, row_end); the ops tier spreads ranges over its thread pool.
void cross_entropy_forward_cpu(const CrossEntropyForwardParams& p, int64_t row_begin, int64_t row_end);
void cross_entropy_forward_cuda(const CrossEntropyForwardParams& p, Stream stream);

struct CrossEntropyBackwardParams {
  DType dtype = DType::kFloat32;       // of logits and grad_logits
  const float* grad_losses = nullptr;  // [rows]
  const void* logits = nullptr;        // [rows, vocab], contiguous
  const int64_t* target = nullptr;     // [rows]
  const float* lse = nullptr;          // [rows], from the forward
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t ignore_index = -100;
  // [rows, vocab]: g * (exp(logit - lse) - onehot), rounded once; the target's element is taken
  // as -g * (sum of the other probabilities), the same value without 1 - p_t's cancellation.
  void* grad_logits = nullptr;
};

void cross_entropy_backward_cpu(const CrossEntropyBackwardParams& p, int64_t row_begin, int64_t row_end);
void cross_entropy_backward_cuda(const CrossEntropyBackwardParams& p, Stream stream);

// Whether `t` names a class of a row of `vocab` logits (the ignore index is handled before).
MIXPREC_HOST_DEVICE inline bool target_in_range(int64_t t, int64_t vocab) { return t >= 0 && t < vocab; }

}  // namespace mixprec::kernels
