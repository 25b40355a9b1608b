// The one CUDA multi-tensor launcher every multi-tensor op uses: a TensorGroup is packed into
// launch-metadata tables passed as kernel parameters, one block per 64 Ki-element chunk.
//
// Limits (documented in README "Multi-tensor launcher"):
// - a table is a kernel parameter of at most kTableBytes (CUDA >= 12.1 and sm_70+ accept up to
//   32764 bytes), so one launch holds TensorTable<N>::kCapacity tensors (about 440 with 6 lists,
//   about 830 with 2); larger groups take several launches, each a single kernel;
// - a tensor has fewer than 2^31 chunks (2^47 elements); a launch fewer than 2^31 blocks.
// The table lives in the constant bank and costs no host-to-device copy or synchronization,
// so launches are CUDA-graph capturable. Every block reads one table entry (found by a binary
// search over block_start), so the reads are uniform across the block and cheap.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/multi_tensor.h"

#define MIXPREC_CUDA_CHECK(expr)                                                                        \
  do {                                                                                                  \
    const cudaError_t mixprec_err_ = (expr);                                                            \
    if (mixprec_err_ != cudaSuccess)                                                                    \
      throw std::runtime_error(std::string("mixprec: CUDA error ") + cudaGetErrorString(mixprec_err_) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__));                         \
  } while (0)

namespace mixprec::kernels {

constexpr int kBlockThreads = 512;
constexpr int kTableBytes = 31 * 1024;  // leaves ~1 KB of the 32764-byte limit to the functor

template <int NLists> struct TensorTable {
  static constexpr int kListSlots = NLists > 0 ? NLists : 1;
  static constexpr int kEntryBytes = kListSlots * 8 + 8 + 4 + 4 + 4 + 1;
  static constexpr int kCapacity = (kTableBytes - 16) / kEntryBytes;

  void* ptrs[kListSlots][kCapacity];
  int64_t numel[kCapacity];
  int32_t block_start[kCapacity + 1];  // first block of each entry; block_start[count] = grid
  int32_t first_chunk[kCapacity];      // global chunk id, for per-chunk scratch
  int32_t arg_index[kCapacity];        // position in the op's argument lists
  uint8_t aligned[kCapacity];          // every pointer kVectorAlignment-aligned
  int32_t count;
};

// What a block works on: chunk `chunk` of table entry `t`.
struct ChunkCtx {
  int t;
  int64_t begin;  // first element of the chunk in the tensor
  int n;          // elements in the chunk
  bool vec_ok;    // vector loads allowed (all pointers aligned)
  int32_t arg_index;
  int32_t global_chunk;
};

template <typename T, int NLists>
__device__ __forceinline__ T* chunk_ptr(const TensorTable<NLists>& table, const ChunkCtx& c, int list) {
  return static_cast<T*>(table.ptrs[list][c.t]) + c.begin;
}

// ---- element conversions: all arithmetic is fp32 ("opmath"), storage any of the three ----------
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Raw storage bits of one element, and back: the vector paths below move uint4 words and
// (un)pack them in registers, so wide loads and stores stay single 16-byte instructions for
// every dtype (a struct of __half does not: its copies are split into 2-byte accesses).
template <typename T> __device__ __forceinline__ uint32_t to_bits(float v);
template <> __device__ __forceinline__ uint32_t to_bits<float>(float v) { return __float_as_uint(v); }
template <> __device__ __forceinline__ uint32_t to_bits<__half>(float v) {
  return __half_as_ushort(__float2half_rn(v));
}
template <> __device__ __forceinline__ uint32_t to_bits<__nv_bfloat16>(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
template <typename T> __device__ __forceinline__ float from_bits(uint32_t b);
template <> __device__ __forceinline__ float from_bits<float>(uint32_t b) { return __uint_as_float(b); }
template <> __device__ __forceinline__ float from_bits<__half>(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}
template <> __device__ __forceinline__ float from_bits<__nv_bfloat16>(uint32_t b) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b)));
}

// The 16 / sizeof(T) elements of one 16-byte word, as fp32 values at r[offset...].
template <typename T, int N> __device__ __forceinline__ void unpack_word(const uint4 v, int offset, float (&r)[N]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if constexpr (sizeof(T) == 4) {
      r[offset + q] = from_bits<T>(w[q]);
    } else {
      r[offset + 2 * q] = from_bits<T>(w[q] & 0xffffu);
      r[offset + 2 * q + 1] = from_bits<T>(w[q] >> 16);
    }
  }
}

// One 16-byte word of elements starting at i, kept packed (a kernel that holds a row in
// registers holds half as many fp16 words as floats): one access when the word is inside n and
// aligned, element-wise with zero bits past n otherwise (zero bits are 0.0 in every dtype).
template <typename T> __device__ __forceinline__ uint4 load_word(const T* p, int64_t i, int n, bool vec_ok) {
  constexpr int kElems = 16 / sizeof(T);
  if (vec_ok && i + kElems <= n) return *reinterpret_cast<const uint4*>(p + i);
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < kElems; ++j) {
    // to_bits(to_float(.)) is exact: every T's values are fp32 values.
    const uint32_t bits = i + j < n ? to_bits<T>(to_float(p[i + j])) : 0u;
    if constexpr (sizeof(T) == 4) w[j] = bits;
    else w[j / 2] |= bits << (16 * (j % 2));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Loads N elements starting at i into fp32 registers: 16-byte accesses when the whole vector is
// inside the chunk and the tensor is aligned, element-wise (zero-filled past n) otherwise.
template <typename T, int N>
__device__ __forceinline__ void load(const T* p, int64_t i, int n, bool vec_ok, float (&r)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "a vector must be whole 16-byte words");
  if (vec_ok && i + N <= n) {
    const uint4* src = reinterpret_cast<const uint4*>(p + i);
#pragma unroll
    for (int k = 0; k < static_cast<int>(N * sizeof(T) / 16); ++k) unpack_word<T>(src[k], k * (16 / sizeof(T)), r);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) r[j] = (i + j < n) ? to_float(p[i + j]) : 0.f;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, int64_t i, int n, bool vec_ok, const float (&r)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "a vector must be whole 16-byte words");
  if (vec_ok && i + N <= n) {
    constexpr int kPerWord = 4 / sizeof(T);
    uint4* dst = reinterpret_cast<uint4*>(p + i);
#pragma unroll
    for (int k = 0; k < static_cast<int>(N * sizeof(T) / 16); ++k) {
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if constexpr (kPerWord == 1) w[q] = to_bits<T>(r[k * 4 + q]);
        else w[q] = to_bits<T>(r[k * 8 + 2 * q]) | (to_bits<T>(r[k * 8 + 2 * q + 1]) << 16);
      }
      // An explicit 16-byte store: a plain uint4 assignment here came out as four 4-byte stores.
      __stwb(dst + k, make_uint4(w[0], w[1], w[2], w[3]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (i + j < n) p[i + j] = from_float<T>(r[j]);
  }
}

// The same through an aligned struct, which the compiler copies through registers as it likes.
// For __half it splits stores into 2-byte accesses (slow for a pass that only moves fp16), but it
// needs fewer registers than the word packing above: Adam, with five operands per element and
// two resident blocks per SM, spills with the words and runs faster this way (measured on the
// H200: fp32 95% and O2 94% of copy bandwidth, against 85% and 82% with the words).
template <typename T, int N> struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_packed(const T* p, int64_t i, int n, bool vec_ok, float (&r)[N]) {
  if (vec_ok && i + N <= n) {
    const Packed<T, N> pk = *reinterpret_cast<const Packed<T, N>*>(p + i);
#pragma unroll
    for (int j = 0; j < N; ++j) r[j] = to_float(pk.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) r[j] = (i + j < n) ? to_float(p[i + j]) : 0.f;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_packed(T* p, int64_t i, int n, bool vec_ok, const float (&r)[N]) {
  if (vec_ok && i + N <= n) {
    Packed<T, N> pk;
#pragma unroll
    for (int j = 0; j < N; ++j) pk.v[j] = from_float<T>(r[j]);
    *reinterpret_cast<Packed<T, N>*>(p + i) = pk;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (i + j < n) p[i + j] = from_float<T>(r[j]);
  }
}

// Elements per vector: 16 bytes of the narrowest type an op streams (8 for fp16/bf16, 4 for fp32).
template <typename... Ts> constexpr int vec_elems() {
  constexpr size_t narrowest = std::min({sizeof(Ts)...});
  return static_cast<int>(16 / narrowest);
}

// Vectors per thread per iteration, all loaded before any is used: memory-level parallelism.
constexpr int kIlp = 4;

// Calls f(base, stride) once per step of this thread through the chunk: the thread's vectors of
// N elements in that step start at base + u * stride for u < Ilp, so a body that loads all Ilp
// vectors first and computes after keeps Ilp loads per list in flight.
template <int N, int Ilp = kIlp, typename F> __device__ __forceinline__ void for_each_vector_group(int n, F&& f) {
  constexpr int kStride = kBlockThreads * N;
  for (int64_t base = static_cast<int64_t>(threadIdx.x) * N; base < n; base += kStride * Ilp) f(base, kStride);
}

__device__ __forceinline__ bool is_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// Warp-wide sum in a fixed butterfly order; every lane gets the same result.
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide sum and max; every thread gets the result. Uses 32 floats of shared memory.
__device__ __forceinline__ float block_reduce_sum(float v) {
  __shared__ float warp_part[kBlockThreads / 32];
  v = warp_reduce_sum(v);
  if ((threadIdx.x & 31) == 0) warp_part[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x < blockDim.x / 32) ? warp_part[threadIdx.x] : 0.f;
  if (threadIdx.x < 32) {
    v = warp_reduce_sum(v);
    if (threadIdx.x == 0) warp_part[0] = v;
  }
  __syncthreads();
  const float r = warp_part[0];
  __syncthreads();  // the buffer may be reused by the caller's next reduction
  return r;
}

// max that propagates NaN (fmaxf drops it, and a NaN must never pass as finite).
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

__device__ __forceinline__ float block_reduce_max(float v) {
  __shared__ float warp_part[kBlockThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) warp_part[threadIdx.x >> 5] = v;
  __syncthreads();
  // Lanes past the block's warps hold -inf, the identity of max: a 0 there would raise the max of
  // an all-negative block (cross_entropy's row max) to 0.
  v = (threadIdx.x < blockDim.x / 32) ? warp_part[threadIdx.x] : -INFINITY;
  if (threadIdx.x < 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) warp_part[0] = v;
  }
  __syncthreads();
  const float r = warp_part[0];
  __syncthreads();
  return r;
}

// At least two blocks per SM (<= 64 registers a thread): one 512-thread block alone leaves too
// few loads in flight to saturate HBM.
// An op is persistent unless it says otherwise (static constexpr bool kPersistent = false).
template <typename Op, typename = void> struct IsPersistent : std::true_type {};
template <typename Op>
struct IsPersistent<Op, std::void_t<decltype(Op::kPersistent)>> : std::bool_constant<Op::kPersistent> {};

// Persistent ops run on a grid of what the GPU holds resident at once, each block walking the
// chunks block, block + grid, ... so no block pays start-up for one short chunk (a 64 Ki-element
// fp16 chunk is only 128 KB) and neighbouring blocks stream neighbouring memory. Ops whose
// per-chunk state is heavy (Adam: the loop's registers would spill) take one block per chunk.
// Runs `op` on chunk `block` of the table (a global block index over the table's entries).
template <int NLists, typename Op>
__device__ __forceinline__ void run_chunk(const TensorTable<NLists>& table, const Op& op, int32_t block) {
  int lo = 0, hi = table.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table.block_start[mid] <= block) lo = mid;
    else hi = mid - 1;
  }
  ChunkCtx c;
  c.t = lo;
  const int32_t chunk = block - table.block_start[lo];
  c.begin = static_cast<int64_t>(chunk) * kChunkElems;
  c.n = static_cast<int>(min(static_cast<int64_t>(kChunkElems), table.numel[lo] - c.begin));
  c.vec_ok = table.aligned[lo] != 0;
  c.arg_index = table.arg_index[lo];
  c.global_chunk = table.first_chunk[lo] + chunk;
  op(table, c);
}

template <int NLists, typename Op>
__global__ void __launch_bounds__(kBlockThreads, 2)
    multi_tensor_kernel(const __grid_constant__ TensorTable<NLists> table, const Op op) {
  if constexpr (IsPersistent<Op>::value) {
    const int32_t total = table.block_start[table.count];
    for (int32_t block = static_cast<int32_t>(blockIdx.x); block < total; block += static_cast<int32_t>(gridDim.x))
      run_chunk(table, op, block);
  } else {
    run_chunk(table, op, static_cast<int32_t>(blockIdx.x));
  }
}

// The current device's streaming multiprocessors, cached per device (a launch-time query).
inline int current_sm_count() {
  int device = 0;
  MIXPREC_CUDA_CHECK(cudaGetDevice(&device));
  static int counts[256] = {};
  if (device < 0 || device >= 256) throw std::runtime_error("mixprec: CUDA device index out of range");
  if (counts[device] == 0)
    MIXPREC_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  return counts[device];
}

// Blocks of `kernel` the current device holds resident at once (SMs x occupancy), cached.
template <typename Kernel> int resident_blocks(Kernel kernel) {
  static int per_sm = 0;  // one value per kernel instantiation; the same on every GPU model
  if (per_sm == 0) MIXPREC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, 0));
  return std::max(1, per_sm) * current_sm_count();
}

// Packs group `g` into as few tables as fit and calls launch(table, blocks) for each, where tensor
// i takes blocks_of(i) consecutive blocks of the launch.
template <int NLists, typename BlocksOf, typename Launch>
void for_each_table(const TensorGroup& g, BlocksOf&& blocks_of, Launch&& launch) {
  using Table = TensorTable<NLists>;
  if (g.num_lists != NLists) throw std::logic_error("mixprec: tensor group has the wrong number of lists");
  Table table;
  table.count = 0;
  int64_t blocks = 0;
  auto flush = [&] {
    if (table.count == 0) return;
    table.block_start[table.count] = static_cast<int32_t>(blocks);
    launch(table, static_cast<unsigned>(blocks));
    table.count = 0;
    blocks = 0;
  };
  for (int64_t i = 0; i < g.size(); ++i) {
    const int64_t b = blocks_of(i);
    if (b >= INT32_MAX || g.first_chunk[i] + num_chunks(g.numel[i]) >= INT32_MAX)
      throw std::invalid_argument("mixprec: tensor too large for the multi-tensor launcher (2^31 chunks)");
    if (table.count == Table::kCapacity || blocks + b >= INT32_MAX) flush();
    const int e = table.count++;
    for (int k = 0; k < NLists; ++k) table.ptrs[k][e] = g.ptrs[k][i];
    table.numel[e] = g.numel[i];
    table.block_start[e] = static_cast<int32_t>(blocks);
    table.first_chunk[e] = static_cast<int32_t>(g.first_chunk[i]);
    table.arg_index[e] = g.index[i];
    table.aligned[e] = g.aligned(i) ? 1 : 0;
    blocks += b;
  }
  flush();
}

// Whether persistent ops get a resident-sized grid (the default) or one block per chunk, which
// turns their chunk loop into one iteration. MIXPREC_PERSISTENT_GRID=chunks picks the latter, so
// that a benchmark can compare the two launch shapes of the same build (benchmarks/RESULTS.md).
inline bool persistent_grid() {
  static const bool on = [] {
    const char* env = std::getenv("MIXPREC_PERSISTENT_GRID");
    return env == nullptr || std::strcmp(env, "chunks") != 0;
  }();
  return on;
}

// Launches `op` over every chunk of `g` (whose num_lists must equal NLists), one block a chunk.
template <int NLists, typename Op> void launch_multi_tensor(const TensorGroup& g, const Op& op, Stream stream) {
  using Table = TensorTable<NLists>;
  static_assert(sizeof(Table) + sizeof(Op) <= 32764, "kernel parameters exceed CUDA's 32764-byte limit");
  for_each_table<NLists>(
      g, [&](int64_t i) { return num_chunks(g.numel[i]); },
      [&](const Table& table, unsigned blocks) {
        const unsigned grid = IsPersistent<Op>::value && persistent_grid()
                                  ? std::min<unsigned>(blocks, resident_blocks(multi_tensor_kernel<NLists, Op>))
                                  : blocks;
        multi_tensor_kernel<NLists, Op><<<grid, kBlockThreads, 0, stream>>>(table, op);
        MIXPREC_CUDA_CHECK(cudaGetLastError());
      });
}

// Calls f(tag) with tag a value of the CUDA storage type for `d` (float, __half, __nv_bfloat16).
template <typename F> decltype(auto) dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat16:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  throw std::logic_error("mixprec: unknown dtype");
}

}  // namespace mixprec::kernels
