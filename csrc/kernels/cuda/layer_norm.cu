// CUDA kernels of LayerNorm (kernels/layer_norm.h). One warp per row throughout: a row's sums are
// warp reductions, and the row's later passes re-use it (from registers for rows up to 2048
// fp16/bf16 or 1024 fp32 columns, from the cache otherwise), so HBM sees each tensor once. The
// backward's warps also add dy * xhat and dy into private shared-memory rows (a lane always owns
// the same columns, so there are no atomics); a block then adds its warps' rows in warp order
// into one row of fp32 partials, and column_sum.cuh adds those in split order.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include "kernels/column_sum.cuh"
#include "kernels/layer_norm.h"
#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels {
namespace {

constexpr int kForwardWarps = 4;    // rows per forward block
constexpr int kBackwardWarps = 8;   // most rows in flight per backward block
constexpr int kBackwardBlocksPerSM = 2;
// Shared memory of one backward block: two blocks fit an H100/H200 SM (228 KB). A warp needs
// 2 x padded cols floats, so up to 8 warps for 1536 columns, 1 warp for 12800
// (kLayerNormMaxCudaCols stays below that).
constexpr int kBackwardSmemBytes = 100 * 1024;

template <typename T>
constexpr int row_vector() {
  return vec_elems<T>();
}

// A lane's columns are lane*V + k*32*V + j (k-th stride, j-th element of its vector). In the
// backward's shared rows they sit at (k*V + j)*32 + lane: for each (k, j) the 32 lanes touch 32
// consecutive words, one per bank.
template <typename T>
__device__ __forceinline__ int shared_slot(int k, int j, int lane) {
  return (k * row_vector<T>() + j) * 32 + lane;
}

// A row's strides: 32 lanes x one 16-byte vector each.
int row_strides(DType dtype, int64_t cols) {
  const int64_t stride = 32 * vector_elems(dtype);
  return static_cast<int>((cols + stride - 1) / stride);
}

int64_t padded_cols(DType dtype, int64_t cols) {
  return int64_t{row_strides(dtype, cols)} * 32 * vector_elems(dtype);
}

int backward_warps(DType dtype, int64_t cols) {
  const int64_t per_warp = 2 * padded_cols(dtype, cols) * static_cast<int64_t>(sizeof(float));
  return static_cast<int>(std::min<int64_t>(kBackwardWarps, kBackwardSmemBytes / per_warp));
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A lane's values of stride k of a row: unpacked from the words the kernel holds (kStrides > 0),
// or loaded (kStrides == 0: any width, a second pass re-reads the row from the cache).
template <typename T, int kStrides, int kWords>
__device__ __forceinline__ void row_values(const uint4 (&words)[kWords], const T* row, int k, int c, int n,
                                           bool vec_ok, float (&r)[row_vector<T>()]) {
  if constexpr (kStrides > 0) unpack_word<T>(words[k], 0, r);
  else load<T, row_vector<T>()>(row, c, n, vec_ok, r);
}

// kStrides > 0 serves rows of at most kStrides * 32 vectors: the warp loads its row's words once
// into registers and the three passes (sum, squared deviations, output) unpack them; before, each
// pass walked the row one dependent load at a time (re-reads from the cache, still a latency each).
template <typename T, int kStrides>
__global__ void __launch_bounds__(kForwardWarps * 32) layer_norm_forward_kernel(const LayerNormForwardParams p,
                                                                               bool vec_ok) {
  constexpr int V = row_vector<T>();
  constexpr int kWords = kStrides > 0 ? kStrides : 1;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kForwardWarps + (threadIdx.x >> 5);
  if (row >= p.rows) return;  // the whole warp: rows are warp-uniform
  const int n = static_cast<int>(p.cols);
  const int strides = kStrides > 0 ? kStrides : (n + 32 * V - 1) / (32 * V);
  const T* x = static_cast<const T*>(p.input) + row * p.cols;
  uint4 words[kWords];
  if constexpr (kStrides > 0) {
#pragma unroll
    for (int k = 0; k < kStrides; ++k) words[k] = load_word<T>(x, lane * V + k * 32 * V, n, vec_ok);
  }

  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < strides; ++k) {
    float v[V];
    row_values<T, kStrides>(words, x, k, lane * V + k * 32 * V, n, vec_ok, v);  // zero past the row's end
#pragma unroll
    for (int j = 0; j < V; ++j) sum += v[j];
  }
  const float mean = warp_reduce_sum(sum) / static_cast<float>(n);
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < strides; ++k) {
    const int c = lane * V + k * 32 * V;
    float v[V];
    row_values<T, kStrides>(words, x, k, c, n, vec_ok, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = c + j < n ? v[j] - mean : 0.f;
      squares += d * d;
    }
  }
  const float rstd = 1.f / sqrtf(warp_reduce_sum(squares) / static_cast<float>(n) + p.eps);

  const T* w = static_cast<const T*>(p.weight);
  const T* b = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.out) + row * p.cols;
#pragma unroll
  for (int k = 0; k < strides; ++k) {
    const int c = lane * V + k * 32 * V;
    float v[V], wv[V], bv[V];
    row_values<T, kStrides>(words, x, k, c, n, vec_ok, v);
    if (w != nullptr) load<T, V>(w, c, n, vec_ok, wv);
    if (b != nullptr) load<T, V>(b, c, n, vec_ok, bv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float normed = (v[j] - mean) * rstd;
      v[j] = (w != nullptr ? normed * wv[j] : normed) + (b != nullptr ? bv[j] : 0.f);
    }
    store<T, V>(y, c, n, vec_ok, v);
  }
  if (lane == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
}

// kStrides > 0 serves rows of at most kStrides * 32 vectors: a warp loads all its row's words
// into registers at once and both passes use them. Before this (the kStrides == 0 form for every
// width) each pass walked the row one dependent 16-byte load at a time, and 4096 x 1280 ran
// latency-bound at a quarter of the copy bandwidth (benchmarks/RESULTS.md).
template <typename T, int kStrides>
__global__ void __launch_bounds__(kBackwardWarps * 32, kBackwardBlocksPerSM) layer_norm_backward_kernel(const LayerNormBackwardParams p,
                                                                                 bool vec_ok) {
  constexpr int V = row_vector<T>();
  constexpr int kWords = kStrides > 0 ? kStrides : 1;
  extern __shared__ float shared_rows[];  // [warps][2][padded cols]: dw, then db, per warp
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = static_cast<int>(p.cols);
  const int strides = kStrides > 0 ? kStrides : (n + 32 * V - 1) / (32 * V);  // a lane's vectors per row
  const int padded = strides * 32 * V;
  const bool params = p.partials != nullptr;
  float* acc_w = shared_rows + static_cast<int64_t>(warp) * 2 * padded;
  float* acc_b = acc_w + padded;
  if (params) {
    for (int i = lane; i < padded; i += 32) acc_w[i] = acc_b[i] = 0.f;
    __syncwarp();
  }
  const T* w = static_cast<const T*>(p.weight);

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + warp; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    const T* x = static_cast<const T*>(p.input) + row * p.cols;
    const T* dy = static_cast<const T*>(p.grad_out) + row * p.cols;
    const float mean = p.mean[row], rstd = p.rstd[row];
    uint4 x_words[kWords], dy_words[kWords];
    if constexpr (kStrides > 0) {
#pragma unroll
      for (int k = 0; k < kStrides; ++k) {
        x_words[k] = load_word<T>(x, lane * V + k * 32 * V, n, vec_ok);
        dy_words[k] = load_word<T>(dy, lane * V + k * 32 * V, n, vec_ok);  // zero past n: adds nothing
      }
    }
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < strides; ++k) {
      const int c = lane * V + k * 32 * V;
      float xv[V], dv[V], wv[V];
      row_values<T, kStrides>(x_words, x, k, c, n, vec_ok, xv);
      row_values<T, kStrides>(dy_words, dy, k, c, n, vec_ok, dv);
      if (w != nullptr) load<T, V>(w, c, n, vec_ok, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xhat = (xv[j] - mean) * rstd;
        const float g = w != nullptr ? dv[j] * wv[j] : dv[j];
        sum_g += g;
        sum_gx += g * xhat;
        if (params) {
          const int s = shared_slot<T>(k, j, lane);
          acc_w[s] += dv[j] * xhat;
          acc_b[s] += dv[j];
        }
      }
    }
    if (p.grad_input == nullptr) continue;
    const float mean_g = warp_reduce_sum(sum_g) / static_cast<float>(n);
    const float mean_gx = warp_reduce_sum(sum_gx) / static_cast<float>(n);
    T* dx = static_cast<T*>(p.grad_input) + row * p.cols;
#pragma unroll
    for (int k = 0; k < strides; ++k) {
      const int c = lane * V + k * 32 * V;
      float xv[V], dv[V], wv[V];
      row_values<T, kStrides>(x_words, x, k, c, n, vec_ok, xv);
      row_values<T, kStrides>(dy_words, dy, k, c, n, vec_ok, dv);
      if (w != nullptr) load<T, V>(w, c, n, vec_ok, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xhat = (xv[j] - mean) * rstd;
        const float g = w != nullptr ? dv[j] * wv[j] : dv[j];
        xv[j] = rstd * (g - mean_g - xhat * mean_gx);
      }
      store<T, V>(dx, c, n, vec_ok, xv);
    }
  }
  if (!params) return;
  __syncthreads();
  // This block's row of partials: its warps' rows added in warp order, back in column order.
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    const int k = c / (32 * V), lane_of = (c % (32 * V)) / V, j = c % V;
    const int s = shared_slot<T>(k, j, lane_of);
    float sw = 0.f, sb = 0.f;
    for (int q = 0; q < warps; ++q) {
      sw += shared_rows[static_cast<int64_t>(q) * 2 * padded + s];
      sb += shared_rows[static_cast<int64_t>(q) * 2 * padded + padded + s];
    }
    p.partials[static_cast<int64_t>(blockIdx.x) * p.cols + c] = sw;
    p.partials[(p.splits + blockIdx.x) * p.cols + c] = sb;
  }
}

// Rows of up to this many strides (2048 fp16/bf16 or 1024 fp32 columns: GPT-2 small to XL, and
// the widths of most LLMs' smaller models) take the register-held forms; their words cost 4
// registers a stride in the forward (x) and 8 in the backward (x and dy).
constexpr int kMaxRegisterStrides = 8;

// The kernel instance for a row of `strides` strides: kernel_of(std::integral_constant<int, k>)
// for k = strides from kMaxRegisterStrides down to 1, k = 0 (the any-width form) past them.
template <int kStrides = kMaxRegisterStrides, typename KernelOf>
auto kernel_for(int strides, KernelOf kernel_of) {
  if constexpr (kStrides == 0) {
    return kernel_of(std::integral_constant<int, 0>{});
  } else {
    return strides == kStrides ? kernel_of(std::integral_constant<int, kStrides>{})
                               : kernel_for<kStrides - 1>(strides, kernel_of);
  }
}

// Dynamic shared memory beyond the default 48 KB needs an opt-in per kernel and device. It is a
// host call, set once for each pair rather than on every launch (73 launches a step on GPT-2 large).
void allow_backward_shared_memory(const void* kernel) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> allowed;
  int device = 0;
  MIXPREC_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (allowed.count({kernel, device}) != 0) return;
  MIXPREC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBackwardSmemBytes));
  allowed.insert({kernel, device});
}

}  // namespace

int64_t layer_norm_cuda_splits(DType dtype, int64_t rows, int64_t cols) {
  const int warps = std::max(1, backward_warps(dtype, cols));  // cols <= kLayerNormMaxCudaCols: at least 1
  if (rows == 0) return 1;
  const int64_t blocks = (rows + warps - 1) / warps;
  return std::max<int64_t>(1, std::min<int64_t>(blocks, static_cast<int64_t>(kBackwardBlocksPerSM) * current_sm_count()));
}

void layer_norm_forward_cuda(const LayerNormForwardParams& p, Stream stream) {
  if (p.rows == 0 || p.cols == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec_ok = p.cols % vec_elems<T>() == 0 && aligned16(p.input) && aligned16(p.out) &&
                        aligned16(p.weight) && aligned16(p.bias);
    const auto blocks = static_cast<unsigned>((p.rows + kForwardWarps - 1) / kForwardWarps);
    const auto kernel = kernel_for(row_strides(p.dtype, p.cols),
                                   [](auto k) { return &layer_norm_forward_kernel<T, decltype(k)::value>; });
    kernel<<<blocks, kForwardWarps * 32, 0, stream>>>(p, vec_ok);
    MIXPREC_CUDA_CHECK(cudaGetLastError());
  });
}

void layer_norm_backward_cuda(const LayerNormBackwardParams& p, Stream stream) {
  if (p.cols == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.cols > kLayerNormMaxCudaCols)
      throw std::invalid_argument("mixprec: layer_norm backward: too many columns for the CUDA kernel");
    const int warps = backward_warps(p.dtype, p.cols);
    if (p.rows > 0) {
      const bool vec_ok = p.cols % vec_elems<T>() == 0 && aligned16(p.input) && aligned16(p.grad_out) &&
                          aligned16(p.weight) && aligned16(p.grad_input);
      const size_t smem =
          p.partials != nullptr ? static_cast<size_t>(warps) * 2 * padded_cols(p.dtype, p.cols) * sizeof(float) : 0;
      const auto kernel = kernel_for(row_strides(p.dtype, p.cols),
                                     [](auto k) { return &layer_norm_backward_kernel<T, decltype(k)::value>; });
      if (smem > 48 * 1024) allow_backward_shared_memory(reinterpret_cast<const void*>(kernel));
      kernel<<<static_cast<unsigned>(p.splits), warps * 32, smem, stream>>>(p, vec_ok);
      MIXPREC_CUDA_CHECK(cudaGetLastError());
    } else if (p.partials != nullptr) {
      // No rows: the parameter gradients are sums of nothing; one split of zeros.
      MIXPREC_CUDA_CHECK(cudaMemsetAsync(p.partials, 0, 2 * p.splits * p.cols * sizeof(float), stream));
    }
    if (p.partials != nullptr) {
      ColumnFinish finish;
      finish.partials = p.partials;
      finish.splits = p.splits;
      finish.cols = p.cols;
      finish.out[0] = p.grad_weight;
      finish.out[1] = p.grad_bias;
      launch_column_finish<T>(finish, 2, stream);
    }
  });
}

}  // namespace mixprec::kernels
