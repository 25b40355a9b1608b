// CUDA pieces shared by the one-warp-per-row norms (LayerNorm, RMSNorm): a row's layout over a
// warp's lanes, register-held rows, the backward's per-warp shared-memory column sums and their
// fixed-order reduction into a block's row of fp32 partials (finished by column_sum.cuh).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include "kernels/column_sum.cuh"
#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels::row_norm {

constexpr int kForwardWarps = 4;   // rows per forward block
constexpr int kBackwardWarps = 8;  // most rows in flight per backward block
constexpr int kBackwardBlocksPerSM = 2;
// Shared memory of one backward block: two blocks fit an H100/H200 SM (228 KB). A warp needs
// `sets` x padded cols floats (LayerNorm 2: dw and db; RMSNorm 1), so LayerNorm takes up to 8
// warps for 1536 columns and 1 warp for 12800.
constexpr int kBackwardSmemBytes = 100 * 1024;
// Rows of up to this many strides (2048 fp16/bf16 or 1024 fp32 columns: GPT-2 small to XL, and
// the widths of most LLMs' smaller models) take the register-held forms; their words cost 4
// registers a stride in the forward (x) and 8 in the backward (x and dy).
constexpr int kMaxRegisterStrides = 8;

template <typename T> constexpr int row_vector() { return vec_elems<T>(); }

// A lane's columns are lane*V + k*32*V + j (k-th stride, j-th element of its vector). In the
// backward's shared rows they sit at (k*V + j)*32 + lane: for each (k, j) the 32 lanes touch 32
// consecutive words, one per bank.
template <typename T> __device__ __forceinline__ int shared_slot(int k, int j, int lane) {
  return (k * row_vector<T>() + j) * 32 + lane;
}

// A row's strides: 32 lanes x one 16-byte vector each.
inline int row_strides(DType dtype, int64_t cols) {
  const int64_t stride = 32 * vector_elems(dtype);
  return static_cast<int>((cols + stride - 1) / stride);
}

inline int64_t padded_cols(DType dtype, int64_t cols) {
  return int64_t{row_strides(dtype, cols)} * 32 * vector_elems(dtype);
}

// Warps of a backward block whose warps each keep `sets` fp32 shared rows.
inline int backward_warps(DType dtype, int64_t cols, int sets) {
  const int64_t per_warp = sets * padded_cols(dtype, cols) * static_cast<int64_t>(sizeof(float));
  return static_cast<int>(std::min<int64_t>(kBackwardWarps, kBackwardSmemBytes / per_warp));
}

// Backward blocks (= row splits of the parameter gradients' partials) for a shape: enough to
// fill the SMs twice, fewer for few rows. Depends on the shape and device only, so the
// parameter gradients' summation order is fixed per shape.
inline int64_t backward_splits(DType dtype, int64_t rows, int64_t cols, int sets) {
  const int warps = std::max(1, backward_warps(dtype, cols, sets));  // cols within the family's limit: >= 1
  if (rows == 0) return 1;
  const int64_t blocks = (rows + warps - 1) / warps;
  return std::max<int64_t>(1,
                           std::min<int64_t>(blocks, static_cast<int64_t>(kBackwardBlocksPerSM) * current_sm_count()));
}

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A lane's values of stride k of a row: unpacked from the words the kernel holds (kStrides > 0),
// or loaded (kStrides == 0: any width, a second pass re-reads the row from the cache).
template <typename T, int kStrides, int kWords>
__device__ __forceinline__ void row_values(const uint4 (&words)[kWords], const T* row, int k, int c, int n, bool vec_ok,
                                           float (&r)[row_vector<T>()]) {
  if constexpr (kStrides > 0) unpack_word<T>(words[k], 0, r);
  else load<T, row_vector<T>()>(row, c, n, vec_ok, r);
}

// Loads a row's words into registers (kStrides > 0; zero past n, so they add nothing).
template <typename T, int kStrides, int kWords>
__device__ __forceinline__ void load_row_words(const T* row, int lane, int n, bool vec_ok, uint4 (&words)[kWords]) {
  if constexpr (kStrides > 0) {
    constexpr int V = row_vector<T>();
#pragma unroll
    for (int k = 0; k < kStrides; ++k) words[k] = load_word<T>(row, lane * V + k * 32 * V, n, vec_ok);
  }
}

// Stride k of a lane's part of a backward row: xhat = (x - mean) * rstd (mean 0 for RMSNorm, which
// leaves x exact) and g = dy * w (dy where w is null) per element, dy kept: the one definition
// both passes of both norms evaluate. TW: the weight's storage (T's, or float for RMSNorm).
template <typename T, typename TW, int kStrides, int kWords>
__device__ __forceinline__ void backward_terms(const uint4 (&x_words)[kWords], const uint4 (&dy_words)[kWords],
                                               const T* x, const T* dy, const TW* w, int k, int lane, int n,
                                               bool vec_ok, float mean, float rstd, float (&xhat)[row_vector<T>()],
                                               float (&dv)[row_vector<T>()], float (&g)[row_vector<T>()]) {
  constexpr int V = row_vector<T>();
  const int c = lane * V + k * 32 * V;
  float wv[V];
  row_values<T, kStrides>(x_words, x, k, c, n, vec_ok, xhat);
  row_values<T, kStrides>(dy_words, dy, k, c, n, vec_ok, dv);
  if (w != nullptr) load<TW, V>(w, c, n, vec_ok, wv);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    xhat[j] = (xhat[j] - mean) * rstd;
    g[j] = w != nullptr ? dv[j] * wv[j] : dv[j];
  }
}

// The kernel instance for a row of `strides` strides: kernel_of(std::integral_constant<int, k>)
// for k = strides from kMaxRegisterStrides down to 1, k = 0 (the any-width form) past them.
template <int kStrides = kMaxRegisterStrides, typename KernelOf> auto kernel_for(int strides, KernelOf kernel_of) {
  if constexpr (kStrides == 0) {
    return kernel_of(std::integral_constant<int, 0>{});
  } else {
    return strides == kStrides ? kernel_of(std::integral_constant<int, kStrides>{})
                               : kernel_for<kStrides - 1>(strides, kernel_of);
  }
}

// Dynamic shared memory beyond the default 48 KB needs an opt-in per kernel and device. It is a
// host call, set once for each pair rather than on every launch (73 launches a step on GPT-2 large).
inline void allow_backward_shared_memory(const void* kernel) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> allowed;
  int device = 0;
  MIXPREC_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (allowed.count({kernel, device}) != 0) return;
  MIXPREC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBackwardSmemBytes));
  allowed.insert({kernel, device});
}

// A warp's shared rows, zeroed: `sets` rows of `padded` floats at shared + warp * sets * padded.
template <int kSets> __device__ __forceinline__ float* warp_shared_rows(float* shared, int warp, int lane, int padded) {
  float* rows = shared + static_cast<int64_t>(warp) * kSets * padded;
  for (int i = lane; i < kSets * padded; i += 32) rows[i] = 0.f;
  __syncwarp();
  return rows;
}

// After every warp of the block has added its rows: this block's row of partials for each set,
// its warps' shared rows added in warp order, back in column order. Set s of split b goes to
// partials[(s * splits + b) * cols + c] (column_sum.cuh's layout).
template <typename T, int kSets>
__device__ __forceinline__ void write_block_partials(const float* shared, int warps, int padded, int n, int64_t splits,
                                                     float* partials) {
  __syncthreads();
  constexpr int V = row_vector<T>();
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    const int k = c / (32 * V), lane_of = (c % (32 * V)) / V, j = c % V;
    const int slot = shared_slot<T>(k, j, lane_of);
    float sums[kSets] = {};
    for (int q = 0; q < warps; ++q)
#pragma unroll
      for (int s = 0; s < kSets; ++s) sums[s] += shared[(static_cast<int64_t>(q) * kSets + s) * padded + slot];
#pragma unroll
    for (int s = 0; s < kSets; ++s) partials[(s * splits + blockIdx.x) * n + c] = sums[s];
  }
}

// The host side of a row norm's backward: `kernel` (a backward instance taking (p, vec_ok)) over
// p.splits blocks with each warp's `kSets` shared rows when p.partials is set, then the column
// finish of the kSets sums into outs (TOut: the parameters' dtype). Params has rows, cols,
// splits and partials as LayerNormBackwardParams does.
template <typename TOut, int kSets, typename Kernel, typename Params>
void launch_backward(Kernel kernel, const Params& p, DType dtype, bool vec_ok, void* const (&outs)[kSets],
                     cudaStream_t stream) {
  if (p.rows > 0) {
    const int warps = backward_warps(dtype, p.cols, kSets);
    const size_t smem =
        p.partials != nullptr ? static_cast<size_t>(warps) * kSets * padded_cols(dtype, p.cols) * sizeof(float) : 0;
    if (smem > 48 * 1024) allow_backward_shared_memory(reinterpret_cast<const void*>(kernel));
    kernel<<<static_cast<unsigned>(p.splits), warps * 32, smem, stream>>>(p, vec_ok);
    MIXPREC_CUDA_CHECK(cudaGetLastError());
  } else if (p.partials != nullptr) {
    // No rows: the parameter gradients are sums of nothing; one split of zeros.
    MIXPREC_CUDA_CHECK(cudaMemsetAsync(p.partials, 0, kSets * p.splits * p.cols * sizeof(float), stream));
  }
  if (p.partials == nullptr) return;
  ColumnFinish finish;
  finish.partials = p.partials;
  finish.splits = p.splits;
  finish.cols = p.cols;
  for (int s = 0; s < kSets; ++s) finish.out[s] = outs[s];
  launch_column_finish<TOut>(finish, kSets, stream);
}

}  // namespace mixprec::kernels::row_norm
