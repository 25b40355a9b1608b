// Torch-free description of a multi-tensor operation's operands, shared by the CPU and CUDA
// kernel tiers: tensors grouped by dtype, split into fixed-size chunks that are the unit of work.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define MIXPREC_HOST_DEVICE __host__ __device__
#else
#define MIXPREC_HOST_DEVICE
#endif

struct CUstream_st;  // cudaStream_t, without pulling CUDA headers into host-only code

namespace mixprec::kernels {

using Stream = CUstream_st*;

enum class DType : int8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Elements of `dtype` in one 16-byte vector (the host's twin of multi_tensor.cuh's vec_elems<T>).
constexpr int vector_elems(DType dtype) { return dtype == DType::kFloat32 ? 4 : 8; }

// Every multi-tensor op splits each tensor into chunks of this many elements; a chunk is one
// CUDA block's work and one CPU task's. 64 Ki elements keeps a block busy for several
// iterations of 16-byte loads, and per-chunk partial results (norms) small.
constexpr int64_t kChunkElems = 65536;

// The most tensor lists (params, grads, states, master, ...) one op can stream through: 8 for
// Adam's 8-bit moments (their two scale lists); a launch's table holds NLists, not this.
constexpr int kMaxLists = 8;

// Pointers are taken as 32-byte aligned (the widest vector any kernel loads); tensors that are
// not (views at odd offsets) take the element-wise path inside the same kernels.
constexpr uintptr_t kVectorAlignment = 32;

MIXPREC_HOST_DEVICE inline int64_t num_chunks(int64_t numel) { return (numel + kChunkElems - 1) / kChunkElems; }

// Row splits of the CPU's column sums (bias and LayerNorm parameter gradients): blocks of 1024
// rows, fixed by the shape alone, so the sums do not depend on the thread count.
constexpr int64_t kCpuRowsPerSplit = 1024;
inline int64_t cpu_row_splits(int64_t rows) {
  return rows <= kCpuRowsPerSplit ? 1 : (rows + kCpuRowsPerSplit - 1) / kCpuRowsPerSplit;
}

// A group of tensors sharing one dtype per list: the unit a kernel is instantiated for. Lists
// hold raw data pointers; list k's tensor i has the same numel as every other list's tensor i.
struct TensorGroup {
  int num_lists = 0;
  DType dtypes[kMaxLists] = {};
  std::vector<void*> ptrs[kMaxLists];
  std::vector<int64_t> numel;
  std::vector<int32_t> index;            // position of the tensor in the op's argument lists
  std::vector<int64_t> first_chunk;      // global id of its first chunk, for per-chunk scratch
  std::vector<int64_t> chunk_prefix{0};  // chunk_prefix[i]: chunks of tensors 0..i-1 in this group

  int64_t size() const { return static_cast<int64_t>(numel.size()); }
  int64_t total_chunks() const { return chunk_prefix.back(); }

  // Appends tensor `arg_index` with one data pointer per list; empty tensors are never added.
  void add(int32_t arg_index, int64_t n, void* const* list_ptrs, int64_t global_first_chunk) {
    for (int k = 0; k < num_lists; ++k) ptrs[k].push_back(list_ptrs[k]);
    numel.push_back(n);
    index.push_back(arg_index);
    first_chunk.push_back(global_first_chunk);
    chunk_prefix.push_back(chunk_prefix.back() + num_chunks(n));
  }

  bool aligned(int64_t i) const {
    for (int k = 0; k < num_lists; ++k)
      if (reinterpret_cast<uintptr_t>(ptrs[k][i]) % kVectorAlignment != 0) return false;
    return true;
  }

  // The tensor that owns group-local chunk `chunk` (binary search over chunk_prefix).
  int64_t tensor_of_chunk(int64_t chunk) const {
    return std::upper_bound(chunk_prefix.begin(), chunk_prefix.end(), chunk) - chunk_prefix.begin() - 1;
  }
};

// One chunk resolved to its tensor, for CPU kernels that walk a range of chunks.
struct ChunkRef {
  int64_t tensor;  // position in the group
  int64_t begin;   // first element of the chunk within the tensor
  int64_t size;    // elements in the chunk (the last chunk of a tensor may be short)
};

inline ChunkRef resolve_chunk(const TensorGroup& g, int64_t chunk) {
  const int64_t t = g.tensor_of_chunk(chunk);
  const int64_t begin = (chunk - g.chunk_prefix[t]) * kChunkElems;
  return {t, begin, std::min(kChunkElems, g.numel[t] - begin)};
}

}  // namespace mixprec::kernels
