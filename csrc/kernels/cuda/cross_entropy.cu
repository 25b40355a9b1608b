// CUDA kernels of the fused cross-entropy: one block per row, 16-byte loads of the low-precision
// logits, an online max / sum-of-exps per thread merged by block reductions, all math in fp32.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cross_entropy.h"
#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels {
namespace {

// Blocks narrower than kBlockThreads for short rows (a multiple of 32: the block reductions
// shuffle whole warps): every thread should own at least one 16-byte vector of the row.
int threads_for(int64_t vocab, int elems_per_vector) {
  const int64_t vectors = (vocab + elems_per_vector - 1) / elems_per_vector;
  const int64_t warps = (vectors + 31) / 32;
  return static_cast<int>(std::min<int64_t>(kBlockThreads, std::max<int64_t>(1, warps) * 32));
}

__device__ __forceinline__ bool row_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
__global__ void __launch_bounds__(kBlockThreads) cross_entropy_forward_kernel(const CrossEntropyForwardParams p) {
  constexpr int N = vec_elems<T>();
  const int64_t row = blockIdx.x;
  const int n = static_cast<int>(p.vocab);
  const T* x = static_cast<const T*>(p.logits) + row * p.vocab;
  const bool vec_ok = row_aligned(x);

  // Per thread: m, the max of its logits, and s = sum of exp(x - m), rescaled when m grows. The
  // rescale costs one expf, paid only when the max changes (rarely, after the first vectors).
  float m = -INFINITY, s = 0.f;
  // Unrolled so that several 16-byte loads per thread are in flight before their exps.
#pragma unroll 4
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * N; i < n; i += static_cast<int64_t>(blockDim.x) * N) {
    float v[N];
    load<T, N>(x, i, n, vec_ok, v);
    float vm = -INFINITY;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (i + j >= n) v[j] = -INFINITY;  // load() zero-fills past the row; a 0 would count as exp(0)
      vm = nan_max(vm, v[j]);
    }
    const float new_m = nan_max(m, vm);
    // While all logits seen are -inf, exp(x - 0) = 0 keeps s at 0 (not exp(-inf + inf) = NaN). A
    // NaN logit makes new_m NaN and everything after it NaN; a +inf gives inf - inf = NaN, as
    // log_softmax does.
    const float base = new_m == -INFINITY ? 0.f : new_m;
    if (new_m != m) s *= expf(m - base);
    float e = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) e += expf(v[j] - base);
    s += e;
    m = new_m;
  }
  const float row_max = block_reduce_max(m);  // NaN-propagating
  const float base = row_max == -INFINITY ? 0.f : row_max;
  const float sum = block_reduce_sum(s * expf(m - base));
  if (threadIdx.x == 0) {
    const float log_sum = logf(sum);
    const int64_t t = p.target[row];
    p.lse[row] = row_max + log_sum;
    // (max - x_t) + log_sum, not lse - x_t: when the target dominates the row the loss is tiny and
    // lse - x_t would be all rounding error of lse; max - x_t is exact there (Sterbenz). A target
    // out of range cannot be reported without a host sync: the row's loss becomes NaN.
    p.losses[row] = t == p.ignore_index           ? 0.f
                    : target_in_range(t, p.vocab) ? (row_max - to_float(x[t])) + log_sum
                                                  : NAN;
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlockThreads) cross_entropy_backward_kernel(const CrossEntropyBackwardParams p) {
  constexpr int N = vec_elems<T>();
  const int64_t row = blockIdx.x;
  const int n = static_cast<int>(p.vocab);
  const T* x = static_cast<const T*>(p.logits) + row * p.vocab;
  T* gx = static_cast<T*>(p.grad_logits) + row * p.vocab;
  const bool vec_ok = row_aligned(x) && row_aligned(gx);
  const int64_t t = p.target[row];
  const bool ignored = t == p.ignore_index;
  const bool bad_target = !ignored && !target_in_range(t, p.vocab);
  // Ignored rows get zeros; rows with a target out of range get NaN (see kernels/cross_entropy.h).
  const float fill = bad_target ? NAN : 0.f;
  const float g = p.grad_losses[row];
  const float lse = p.lse[row];
  // The target's gradient is -g * (sum of the other probabilities), written after the row: see
  // kernels/cpu/cross_entropy.cpp (g * (exp(x_t - lse) - 1) cancels to lse's rounding noise when
  // the target dominates). `others` sums this thread's share; past the row load() gives 0s, but
  // exp(0 - lse) would not be 0, so those lanes are masked.
  float others = 0.f;
  // Unrolled so that several 16-byte loads per thread are in flight before their exps.
#pragma unroll 4
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * N; i < n; i += static_cast<int64_t>(blockDim.x) * N) {
    float v[N];
    if (ignored || bad_target) {
#pragma unroll
      for (int j = 0; j < N; ++j) v[j] = fill;
    } else {
      load<T, N>(x, i, n, vec_ok, v);
      // x - lse <= 0 for finite logits (lse >= the row's max).
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float prob = (i + j == t || i + j >= n) ? 0.f : expf(v[j] - lse);
        others += prob;
        v[j] = g * prob;
      }
    }
    store<T, N>(gx, i, n, vec_ok, v);
  }
  // Every thread joins the reduction (ignored rows too: the branch must be block-uniform); its
  // barriers also order the vector stores above before thread 0's store of the target's element.
  const float sum_others = block_reduce_sum(others);
  if (threadIdx.x == 0 && !ignored && !bad_target) gx[t] = from_float<T>(-g * sum_others);
}

}  // namespace

void cross_entropy_forward_cuda(const CrossEntropyForwardParams& p, Stream stream) {
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int threads = threads_for(p.vocab, vec_elems<T>());
    cross_entropy_forward_kernel<T><<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
    MIXPREC_CUDA_CHECK(cudaGetLastError());
  });
}

void cross_entropy_backward_cuda(const CrossEntropyBackwardParams& p, Stream stream) {
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int threads = threads_for(p.vocab, vec_elems<T>());
    cross_entropy_backward_kernel<T><<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
    MIXPREC_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace mixprec::kernels
