// The second pass of a deterministic column sum on CUDA, shared by linear_bias_grad and
// LayerNorm's parameter gradients: fp32 partials [splits, cols] (one row per row split of the
// first pass) added per column in a fixed order and rounded once. A block owns 32 columns; its 8
// row groups each add every 8th split (each warp reads 128 contiguous bytes), then the 8 sums
// are added in group order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels {

constexpr int kColumnLanes = 32;
constexpr int kColumnGroups = 8;

// Up to two sums in one launch (gridDim.y = sets): set s reads partials + s * splits * cols and
// writes out[s]; a null out[s] skips its set.
struct ColumnFinish {
  const float* partials = nullptr;
  int64_t splits = 1;
  int64_t cols = 0;
  void* out[2] = {nullptr, nullptr};
};

template <typename T>
__global__ void __launch_bounds__(kColumnLanes* kColumnGroups) column_finish_kernel(const ColumnFinish f) {
  T* out = static_cast<T*>(f.out[blockIdx.y]);
  if (out == nullptr) return;
  const float* partials = f.partials + static_cast<int64_t>(blockIdx.y) * f.splits * f.cols;
  const int lane = threadIdx.x, group = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnLanes + lane;
  float s = 0.f;
  if (c < f.cols) {
#pragma unroll 4
    for (int64_t k = group; k < f.splits; k += kColumnGroups) s += partials[k * f.cols + c];
  }
  __shared__ float sums[kColumnGroups][kColumnLanes];
  sums[group][lane] = s;
  __syncthreads();
  if (group == 0 && c < f.cols) {
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < kColumnGroups; ++g) total += sums[g][lane];
    out[c] = from_float<T>(total);
  }
}

template <typename T>
void launch_column_finish(const ColumnFinish& f, int sets, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((f.cols + kColumnLanes - 1) / kColumnLanes), static_cast<unsigned>(sets));
  column_finish_kernel<T><<<grid, dim3(kColumnLanes, kColumnGroups), 0, stream>>>(f);
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mixprec::kernels
