// Host launchers of the CUDA FP8 kernels (kernels/fp8.cuh): dtype and format dispatch, grid
// sizes, and the one-thread scale update.
#include "kernels/fp8.cuh"

namespace mixprec::kernels {
namespace {

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T, Fp8Format F> void launch(const Fp8QuantizeParams& p, Stream stream) {
  const int64_t n = p.rows * p.cols;
  if (p.out_t != nullptr) {
    const bool vec =
        p.rows % 4 == 0 && p.cols % 4 == 0 && aligned(p.x, 4 * sizeof(T)) && aligned(p.out, 4) && aligned(p.out_t, 4);
    const dim3 grid(static_cast<unsigned>((p.cols + kFp8Tile - 1) / kFp8Tile),
                    static_cast<unsigned>((p.rows + kFp8Tile - 1) / kFp8Tile));
    if (grid.y > 65535u) throw std::runtime_error("mixprec::fp8_quantize: x has too many rows to transpose");
    fp8_tile_kernel<T, F><<<grid, dim3(kFp8TileThreads, kFp8TileThreads), 0, stream>>>(
        static_cast<const T*>(p.x), p.out, p.out_t, p.rows, p.cols, p.scale, p.amax, vec);
  } else {
    constexpr int kN = 16 / sizeof(T);
    const bool vec = aligned(p.x, 16) && (p.out == nullptr || aligned(p.out, kN));
    // A grid the GPU holds resident a few times over: the loop strides through the rest.
    const int64_t want = (n / kN + kFp8FlatThreads) / kFp8FlatThreads;
    const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, 8LL * current_sm_count())));
    if (p.out != nullptr)
      fp8_flat_kernel<T, F, true>
          <<<blocks, kFp8FlatThreads, 0, stream>>>(static_cast<const T*>(p.x), p.out, n, p.scale, p.amax, vec);
    else
      fp8_flat_kernel<T, F, false>
          <<<blocks, kFp8FlatThreads, 0, stream>>>(static_cast<const T*>(p.x), nullptr, n, nullptr, p.amax, vec);
  }
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

__global__ void fp8_update_scale_kernel(const Fp8ScaleParams p) { fp8_update_scale_step(p); }

}  // namespace

void fp8_quantize_cuda(const Fp8QuantizeParams& p, Stream stream) {
  if (p.rows * p.cols == 0) return;
  dispatch_dtype(p.x_dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.format == Fp8Format::kE4M3) launch<T, Fp8Format::kE4M3>(p, stream);
    else launch<T, Fp8Format::kE5M2>(p, stream);
  });
}

void fp8_update_scale_cuda(const Fp8ScaleParams& p, Stream stream) {
  fp8_update_scale_kernel<<<1, 1, 0, stream>>>(p);
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mixprec::kernels
