// Torch-free entry points of the multi-tensor norm kernels (L2 and infinity norms, global and
// per tensor, fp32 accumulation) for CPU and CUDA, used by gradient clipping and LAMB.
#pragma once

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

enum class NormType : int8_t { kL2 = 0, kInf = 1 };

// First pass: one partial (sum of squares, or max |x|) per chunk into partials[first_chunk + c].
struct NormParams {
  const TensorGroup* group = nullptr;  // one list
  NormType type = NormType::kL2;
  float* partials = nullptr;  // [total chunks over all groups]
};

void norm_partials_cpu(const NormParams& p, int64_t chunk_begin, int64_t chunk_end);
void norm_partials_cuda(const NormParams& p, Stream stream);

// Second pass: per-tensor and total norms from the partials, in a fixed order (deterministic).
struct NormFinalizeParams {
  const TensorGroup* all = nullptr;  // every non-empty tensor, any dtype (lists unused)
  NormType type = NormType::kL2;
  const float* partials = nullptr;
  int64_t total_chunks = 0;
  float* total = nullptr;       // one value
  float* per_tensor = nullptr;  // [num args], may be null; empty tensors must be pre-zeroed
};

void norm_finalize_cpu(const NormFinalizeParams& p);
void norm_finalize_cuda(const NormFinalizeParams& p, Stream stream);

}  // namespace mixprec::kernels
