// CUDA kernels of LayerNorm (kernels/layer_norm.h). One warp per row throughout: a row's sums are
// warp reductions, and the row's later passes re-use it (from registers for rows up to 2048
// fp16/bf16 or 1024 fp32 columns, from the cache otherwise), so HBM sees each tensor once. The
// backward's warps also add dy * xhat and dy into private shared-memory rows (a lane always owns
// the same columns, so there are no atomics); a block then adds its warps' rows in warp order
// into one row of fp32 partials, and column_sum.cuh adds those in split order.
#include <cuda_runtime.h>

#include <stdexcept>

#include "kernels/layer_norm.h"
#include "kernels/row_norm.cuh"

namespace mixprec::kernels {
namespace {

using namespace row_norm;

constexpr int kSets = 2;  // the backward's shared rows per warp: dw, then db

// kStrides > 0 serves rows of at most kStrides * 32 vectors: the warp loads its row's words once
// into registers and the three passes (sum, squared deviations, output) unpack them; before, each
// pass walked the row one dependent load at a time (re-reads from the cache, still a latency each).
template <typename T, int kStrides>
__global__ void __launch_bounds__(kForwardWarps * 32)
    layer_norm_forward_kernel(const LayerNormForwardParams p, bool vec_ok) {
  constexpr int V = row_vector<T>();
  constexpr int kWords = kStrides > 0 ? kStrides : 1;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kForwardWarps + (threadIdx.x >> 5);
  if (row >= p.rows) return;  // the whole warp: rows are warp-uniform
  const int n = static_cast<int>(p.cols);
  const int strides = kStrides > 0 ? kStrides : (n + 32 * V - 1) / (32 * V);
  const T* x = static_cast<const T*>(p.input) + row * p.cols;
  uint4 words[kWords];
  load_row_words<T, kStrides>(x, lane, n, vec_ok, words);

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
__global__ void __launch_bounds__(kBackwardWarps * 32, kBackwardBlocksPerSM)
    layer_norm_backward_kernel(const LayerNormBackwardParams p, bool vec_ok) {
  constexpr int V = row_vector<T>();
  constexpr int kWords = kStrides > 0 ? kStrides : 1;
  extern __shared__ float shared_rows[];  // [warps][2][padded cols]: dw, then db, per warp
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = static_cast<int>(p.cols);
  const int strides = kStrides > 0 ? kStrides : (n + 32 * V - 1) / (32 * V);  // a lane's vectors per row
  const int padded = strides * 32 * V;
  const bool params = p.partials != nullptr;
  float* acc_w = params ? warp_shared_rows<kSets>(shared_rows, warp, lane, padded) : nullptr;
  float* acc_b = params ? acc_w + padded : nullptr;
  const T* w = static_cast<const T*>(p.weight);

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + warp; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    const T* x = static_cast<const T*>(p.input) + row * p.cols;
    const T* dy = static_cast<const T*>(p.grad_out) + row * p.cols;
    const float mean = p.mean[row], rstd = p.rstd[row];
    uint4 x_words[kWords], dy_words[kWords];
    load_row_words<T, kStrides>(x, lane, n, vec_ok, x_words);
    load_row_words<T, kStrides>(dy, lane, n, vec_ok, dy_words);
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < strides; ++k) {
      float xhat[V], dv[V], g[V];
      backward_terms<T, T, kStrides>(x_words, dy_words, x, dy, w, k, lane, n, vec_ok, mean, rstd, xhat, dv, g);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        sum_g += g[j];
        sum_gx += g[j] * xhat[j];
        if (params) {
          const int s = shared_slot<T>(k, j, lane);
          acc_w[s] += dv[j] * xhat[j];
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
      float xhat[V], dv[V], g[V];
      backward_terms<T, T, kStrides>(x_words, dy_words, x, dy, w, k, lane, n, vec_ok, mean, rstd, xhat, dv, g);
#pragma unroll
      for (int j = 0; j < V; ++j) xhat[j] = rstd * (g[j] - mean_g - xhat[j] * mean_gx);
      store<T, V>(dx, lane * V + k * 32 * V, n, vec_ok, xhat);
    }
  }
  if (params) write_block_partials<T, kSets>(shared_rows, warps, padded, n, p.splits, p.partials);
}

}  // namespace

int64_t layer_norm_cuda_splits(DType dtype, int64_t rows, int64_t cols) {
  return backward_splits(dtype, rows, cols, kSets);
}

void layer_norm_forward_cuda(const LayerNormForwardParams& p, Stream stream) {
  if (p.rows == 0 || p.cols == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec_ok = p.cols % vec_elems<T>() == 0 && aligned16(p.input) && aligned16(p.out) && aligned16(p.weight) &&
                        aligned16(p.bias);
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
    const bool vec_ok = p.cols % vec_elems<T>() == 0 && aligned16(p.input) && aligned16(p.grad_out) &&
                        aligned16(p.weight) && aligned16(p.grad_input);
    const auto kernel = kernel_for(row_strides(p.dtype, p.cols),
                                   [](auto k) { return &layer_norm_backward_kernel<T, decltype(k)::value>; });
    void* const outs[kSets] = {p.grad_weight, p.grad_bias};
    launch_backward<T, kSets>(kernel, p, p.dtype, vec_ok, outs, stream);
  });
}

}  // namespace mixprec::kernels
