// CUDA kernels of RMSNorm (kernels/rms_norm.h): LayerNorm's layout without the mean (one warp per
// row, rows held in registers up to 8 strides, kernels/row_norm.cuh), so one reduction in the
// forward and one in the backward; the weight gradient's column sums go per warp into shared
// memory, per block into a row of fp32 partials, and through column_sum.cuh in split order.
#include <cuda_runtime.h>

#include <stdexcept>

#include "kernels/rms_norm.h"
#include "kernels/row_norm.cuh"

namespace mixprec::kernels {
namespace {

using namespace row_norm;

constexpr int kSets = 1;  // the backward's shared rows per warp: dw

// T: input/output storage, TW: weight storage (T's or float). The weight's vector is read with
// T's width (8 fp32 weights are two 16-byte words).
template <typename T, typename TW, int kStrides>
__global__ void __launch_bounds__(kForwardWarps * 32)
    rms_norm_forward_kernel(const RmsNormForwardParams p, bool vec_ok) {
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

  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < strides; ++k) {
    float v[V];
    row_values<T, kStrides>(words, x, k, lane * V + k * 32 * V, n, vec_ok, v);  // zero past the row's end
#pragma unroll
    for (int j = 0; j < V; ++j) squares += v[j] * v[j];
  }
  const float rstd = 1.f / sqrtf(warp_reduce_sum(squares) / static_cast<float>(n) + p.eps);

  const TW* w = static_cast<const TW*>(p.weight);
  T* y = static_cast<T*>(p.out) + row * p.cols;
#pragma unroll
  for (int k = 0; k < strides; ++k) {
    const int c = lane * V + k * 32 * V;
    float v[V], wv[V];
    row_values<T, kStrides>(words, x, k, c, n, vec_ok, v);
    if (w != nullptr) load<TW, V>(w, c, n, vec_ok, wv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float normed = v[j] * rstd;
      v[j] = w != nullptr ? normed * wv[j] : normed;
    }
    store<T, V>(y, c, n, vec_ok, v);
  }
  if (lane == 0) p.rstd[row] = rstd;
}

// The row's x and dy in registers (kStrides > 0) for both passes: sum(g * xhat), then dx.
template <typename T, typename TW, int kStrides>
__global__ void __launch_bounds__(kBackwardWarps * 32, kBackwardBlocksPerSM)
    rms_norm_backward_kernel(const RmsNormBackwardParams p, bool vec_ok) {
  constexpr int V = row_vector<T>();
  constexpr int kWords = kStrides > 0 ? kStrides : 1;
  extern __shared__ float shared_rows[];  // [warps][padded cols]: each warp's dw
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = static_cast<int>(p.cols);
  const int strides = kStrides > 0 ? kStrides : (n + 32 * V - 1) / (32 * V);
  const int padded = strides * 32 * V;
  const bool params = p.partials != nullptr;
  float* acc_w = params ? warp_shared_rows<kSets>(shared_rows, warp, lane, padded) : nullptr;
  const TW* w = static_cast<const TW*>(p.weight);

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + warp; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    const T* x = static_cast<const T*>(p.input) + row * p.cols;
    const T* dy = static_cast<const T*>(p.grad_out) + row * p.cols;
    const float rstd = p.rstd[row];
    uint4 x_words[kWords], dy_words[kWords];
    load_row_words<T, kStrides>(x, lane, n, vec_ok, x_words);
    load_row_words<T, kStrides>(dy, lane, n, vec_ok, dy_words);
    float sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < strides; ++k) {
      float xhat[V], dv[V], g[V];
      backward_terms<T, TW, kStrides>(x_words, dy_words, x, dy, w, k, lane, n, vec_ok, 0.f, rstd, xhat, dv, g);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        sum_gx += g[j] * xhat[j];
        if (params) acc_w[shared_slot<T>(k, j, lane)] += dv[j] * xhat[j];
      }
    }
    if (p.grad_input == nullptr) continue;
    const float mean_gx = warp_reduce_sum(sum_gx) / static_cast<float>(n);
    T* dx = static_cast<T*>(p.grad_input) + row * p.cols;
#pragma unroll
    for (int k = 0; k < strides; ++k) {
      float xhat[V], dv[V], g[V];
      backward_terms<T, TW, kStrides>(x_words, dy_words, x, dy, w, k, lane, n, vec_ok, 0.f, rstd, xhat, dv, g);
#pragma unroll
      for (int j = 0; j < V; ++j) xhat[j] = rstd * (g[j] - xhat[j] * mean_gx);
      store<T, V>(dx, lane * V + k * 32 * V, n, vec_ok, xhat);
    }
  }
  if (params) write_block_partials<T, kSets>(shared_rows, warps, padded, n, p.splits, p.partials);
}

// Calls f(T{}, TW{}) for the input dtype and the weight dtype (the input's, or float32).
template <typename F> void dispatch_dtypes(DType input, DType weight, F&& f) {
  dispatch_dtype(input, [&](auto tag) {
    using T = decltype(tag);
    if (weight == DType::kFloat32) f(T{}, float{});
    else f(T{}, T{});
  });
}

}  // namespace

int64_t rms_norm_cuda_splits(DType dtype, int64_t rows, int64_t cols) {
  return backward_splits(dtype, rows, cols, kSets);
}

void rms_norm_forward_cuda(const RmsNormForwardParams& p, Stream stream) {
  if (p.rows == 0 || p.cols == 0) return;
  dispatch_dtypes(p.dtype, p.weight_dtype, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using TW = decltype(w_tag);
    const bool vec_ok = p.cols % vec_elems<T>() == 0 && aligned16(p.input) && aligned16(p.out) && aligned16(p.weight);
    const auto blocks = static_cast<unsigned>((p.rows + kForwardWarps - 1) / kForwardWarps);
    const auto kernel = kernel_for(row_strides(p.dtype, p.cols),
                                   [](auto k) { return &rms_norm_forward_kernel<T, TW, decltype(k)::value>; });
    kernel<<<blocks, kForwardWarps * 32, 0, stream>>>(p, vec_ok);
    MIXPREC_CUDA_CHECK(cudaGetLastError());
  });
}

void rms_norm_backward_cuda(const RmsNormBackwardParams& p, Stream stream) {
  if (p.cols == 0) return;
  if (p.cols > kRmsNormMaxCudaCols)
    throw std::invalid_argument("mixprec: rms_norm backward: too many columns for the CUDA kernel");
  dispatch_dtypes(p.dtype, p.weight_dtype, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using TW = decltype(w_tag);
    const bool vec_ok = p.cols % vec_elems<T>() == 0 && aligned16(p.input) && aligned16(p.grad_out) &&
                        aligned16(p.weight) && aligned16(p.grad_input);
    const auto kernel = kernel_for(row_strides(p.dtype, p.cols),
                                   [](auto k) { return &rms_norm_backward_kernel<T, TW, decltype(k)::value>; });
    void* const outs[kSets] = {p.grad_weight};
    launch_backward<TW, kSets>(kernel, p, p.dtype, vec_ok, outs, stream);
  });
}

}  // namespace mixprec::kernels
