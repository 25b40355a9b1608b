// Host launchers of the CUDA loss-scaling kernels: dtype dispatch over the device code in
// kernels/loss_scale.cuh, through the shared multi-tensor launcher.
#include "kernels/loss_scale.cuh"

#include <cstdlib>
#include <cstring>

namespace mixprec::kernels {
namespace {

// Whether 2-byte gradients get chunks of the same bytes as fp32's (twice the elements) rather than
// of the same elements (MIXPREC_UNSCALE_CHUNK=bytes; the default is elements). An experiment
// prepared for the H200 (benchmarks/RESULTS.md, 2026-12-03): there the share of copy followed the
// bytes a chunk moves (fp16 in place, 256 KB a chunk: 84-86%; fp32 in place, 512 KB: 92-94%), so
// a fixed cost per chunk looks like what keeps fp16 from fp32's figure. Predicted with bytes-sized
// chunks: fp16 in place 85% -> 88-91%, the fp16 read-only check 74-77% -> 80-85%, fp32 unchanged.
bool byte_sized_chunks() {
  static const bool on = [] {
    const char* env = std::getenv("MIXPREC_UNSCALE_CHUNK");
    return env != nullptr && std::strcmp(env, "bytes") == 0;
  }();
  return on;
}

template <int NLists, typename TIn, typename TOut>
void launch_unscale(const TensorGroup& g, const UnscaleParams& p, Stream stream) {
  if constexpr (sizeof(TIn) == 2) {
    if (byte_sized_chunks()) {
      launch_multi_tensor<NLists>(
          g, UnscaleOp<NLists, TIn, TOut, 2 * kChunkElems>{p.found_inf, p.inv_scale, p.per_tensor_found}, stream);
      return;
    }
  }
  launch_multi_tensor<NLists>(g, UnscaleOp<NLists, TIn, TOut>{p.found_inf, p.inv_scale, p.per_tensor_found}, stream);
}

}  // namespace

void non_finite_check_and_unscale_cuda(const UnscaleParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[0], [&](auto in_tag) {
    using TIn = decltype(in_tag);
    if (g.num_lists == 1) {
      launch_unscale<1, TIn, TIn>(g, p, stream);
      return;
    }
    dispatch_dtype(g.dtypes[1], [&](auto out_tag) { launch_unscale<2, TIn, decltype(out_tag)>(g, p, stream); });
  });
}

__global__ void update_scale_kernel(const ScaleUpdateParams p) { update_scale_step(p); }

void update_scale_cuda(const ScaleUpdateParams& p, Stream stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(p);
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mixprec::kernels
