// CUDA device code of the FP8 family: the saturating cast with its fused amax, flat (16-byte
// loads, one read of x) and tiled (the transpose through shared memory), and the scale update.
#pragma once

#include "kernels/fp8.h"
#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels {

constexpr int kFp8FlatThreads = 256;

// Block-wide max of |x| bits folded into *amax with one atomic per block: the bits of
// non-negative floats order like the floats, so an unsigned atomicMax is a float max (NaN on top).
template <int kThreads> __device__ __forceinline__ void fp8_fold_amax(uint32_t worst, float* amax) {
  __shared__ uint32_t warp_part[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) worst = max(worst, __shfl_xor_sync(0xffffffffu, worst, o));
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  if ((tid & 31) == 0) warp_part[tid >> 5] = worst;
  __syncthreads();
  if (tid < 32) {
    worst = tid < kThreads / 32 ? warp_part[tid] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) worst = max(worst, __shfl_xor_sync(0xffffffffu, worst, o));
    if (tid == 0 && worst != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax), worst);
  }
}

// Flat: each thread takes 16 bytes of x (8 fp16/bf16 or 4 fp32) per step of a grid-stride loop
// and writes their codes in one 8- or 4-byte store. `vec`: x and out aligned for that (else every
// element goes alone); the tail past the last whole vector always does.
template <typename T, Fp8Format F, bool kWrite>
__global__ void __launch_bounds__(kFp8FlatThreads)
    fp8_flat_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, int64_t n, const float* scale, float* amax,
                    bool vec) {
  constexpr int kN = 16 / sizeof(T);
  const float s = kWrite ? *scale : 1.f;
  uint32_t worst = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFp8FlatThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kFp8FlatThreads + threadIdx.x;
  const int64_t whole = vec ? n / kN : 0;
  for (int64_t v = first; v < whole; v += stride) {
    const Packed<T, kN> pk = *reinterpret_cast<const Packed<T, kN>*>(x + v * kN);
    uint8_t codes[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float f = to_float(pk.v[j]);
      worst = max(worst, fp8_abs_bits(f));
      codes[j] = fp8_encode_as<F>(f * s);
    }
    if constexpr (kWrite) {
      if constexpr (kN == 8) {
        uint2 w;
        memcpy(&w, codes, 8);
        *reinterpret_cast<uint2*>(out + v * kN) = w;
      } else {
        uint32_t w;
        memcpy(&w, codes, 4);
        *reinterpret_cast<uint32_t*>(out + v * kN) = w;
      }
    }
  }
  for (int64_t i = whole * kN + first; i < n; i += stride) {
    const float f = to_float(x[i]);
    worst = max(worst, fp8_abs_bits(f));
    if constexpr (kWrite) out[i] = fp8_encode_as<F>(f * s);
  }
  if (amax != nullptr) fp8_fold_amax<kFp8FlatThreads>(worst, amax);
}

// Tiled, with the transpose: a 64 x 64 tile per block of 16 x 16 threads. Thread (tx, ty) casts
// columns 4tx..4tx+3 of rows ty, ty+16, ty+32, ty+48, writes them to out as one 4-byte store and
// keeps them in shared memory; after a barrier it writes 4 consecutive rows of out_t's columns
// the same way. `vec`: rows and cols multiples of 4 and pointers aligned (FP8 GEMM operands, whose
// dims are multiples of 16, always are); otherwise byte by byte with bounds checks.
constexpr int kFp8Tile = 64;
constexpr int kFp8TileThreads = 16;

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kFp8TileThreads* kFp8TileThreads)
    fp8_tile_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t rows,
                    int64_t cols, const float* scale, float* amax, bool vec) {
  __shared__ uint8_t tile[kFp8Tile][kFp8Tile + 4];  // +4: rows start on different banks
  const float s = *scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kFp8Tile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kFp8Tile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  uint32_t worst = 0;
#pragma unroll
  for (int k = 0; k < kFp8Tile / kFp8TileThreads; ++k) {
    const int lr = ty + k * kFp8TileThreads;
    const int64_t r = r0 + lr;
    const int64_t c = c0 + 4 * tx;
    uint8_t codes[4] = {0, 0, 0, 0};
    if (r < rows && vec && c + 4 <= cols) {
      const Packed<T, 4> pk = *reinterpret_cast<const Packed<T, 4>*>(x + r * cols + c);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float f = to_float(pk.v[j]);
        worst = max(worst, fp8_abs_bits(f));
        codes[j] = fp8_encode_as<F>(f * s);
      }
      uint32_t w;
      memcpy(&w, codes, 4);
      *reinterpret_cast<uint32_t*>(out + r * cols + c) = w;
    } else if (r < rows) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c + j < cols) {
          const float f = to_float(x[r * cols + c + j]);
          worst = max(worst, fp8_abs_bits(f));
          codes[j] = fp8_encode_as<F>(f * s);
          out[r * cols + c + j] = codes[j];
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) tile[lr][4 * tx + j] = codes[j];
  }
  __syncthreads();
  // out_t[c][r0 + 4tx .. +3] from the tile's column c - c0.
#pragma unroll
  for (int k = 0; k < kFp8Tile / kFp8TileThreads; ++k) {
    const int lc = ty + k * kFp8TileThreads;
    const int64_t c = c0 + lc;
    const int64_t r = r0 + 4 * tx;
    if (c >= cols) continue;
    uint8_t codes[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) codes[j] = tile[4 * tx + j][lc];
    if (vec && r + 4 <= rows) {
      uint32_t w;
      memcpy(&w, codes, 4);
      *reinterpret_cast<uint32_t*>(out_t + c * rows + r) = w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (r + j < rows) out_t[c * rows + r + j] = codes[j];
    }
  }
  if (amax != nullptr) fp8_fold_amax<kFp8TileThreads * kFp8TileThreads>(worst, amax);
}

}  // namespace mixprec::kernels
