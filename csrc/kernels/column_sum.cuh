// The second pass of a deterministic column sum on CUDA, shared by linear_bias_grad and
// LayerNorm's parameter gradients: fp32 partials [splits, cols] (one row per row split of the
// first pass) added per column in a fixed order and rounded once. A block owns 32 columns; its
// kGroups row groups each add every kGroups-th split (each warp reads 128 contiguous bytes), then
// the groups' sums are added in group order. kGroups is 8, or 32 from kManySplits splits on: with
// 8 a thread walked 33 of LayerNorm's 264 splits on GPT-2 large (3.5 us for 2.7 MB, latency-
// bound), 32 took that to 2.7 us. Few splits (linear_bias_grad's 32) keep 8: a version that chose
// the count at run time was 0.8 us slower there and 1.4 us slower on the 264 (H200,
// benchmarks/RESULTS.md). The count depends on the split count only: the order is fixed per shape.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels {

constexpr int kColumnLanes = 32;
constexpr int kFewSplitsGroups = 8;
constexpr int kManySplitsGroups = 32;
constexpr int64_t kManySplits = 128;  // 4 or more loads a thread with 32 groups

// Up to two sums in one launch (gridDim.y = sets): set s reads partials + s * splits * cols and
// writes out[s]; a null out[s] skips its set.
struct ColumnFinish {
  const float* partials = nullptr;
  int64_t splits = 1;
  int64_t cols = 0;
  void* out[2] = {nullptr, nullptr};
};

template <typename T, int kGroups>
__global__ void __launch_bounds__(kColumnLanes* kGroups) column_finish_kernel(const ColumnFinish f) {
  T* out = static_cast<T*>(f.out[blockIdx.y]);
  if (out == nullptr) return;
  const float* partials = f.partials + static_cast<int64_t>(blockIdx.y) * f.splits * f.cols;
  const int lane = threadIdx.x, group = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnLanes + lane;
  // As measured: 4 loads in flight a thread with 8 groups, 8 with 32.
  constexpr int kUnroll = kGroups == kFewSplitsGroups ? 4 : 8;
  float s = 0.f;
  if (c < f.cols) {
#pragma unroll kUnroll
    for (int64_t k = group; k < f.splits; k += kGroups) s += partials[k * f.cols + c];
  }
  __shared__ float sums[kGroups][kColumnLanes];
  sums[group][lane] = s;
  __syncthreads();
  if (group == 0 && c < f.cols) {
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) total += sums[g][lane];
    out[c] = from_float<T>(total);
  }
}

template <typename T> void launch_column_finish(const ColumnFinish& f, int sets, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((f.cols + kColumnLanes - 1) / kColumnLanes), static_cast<unsigned>(sets));
  if (f.splits >= kManySplits) {
    column_finish_kernel<T, kManySplitsGroups><<<grid, dim3(kColumnLanes, kManySplitsGroups), 0, stream>>>(f);
  } else {
    column_finish_kernel<T, kFewSplitsGroups><<<grid, dim3(kColumnLanes, kFewSplitsGroups), 0, stream>>>(f);
  }
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mixprec::kernels
