// CPU kernels of the loss-scaling family: fused non-finite check and unscale over a range of
// chunks (the ops tier spreads chunks over threads), and the scale update.
#include "kernels/loss_scale.h"

#include "kernels/cpu/convert.h"

namespace mixprec::kernels {
namespace {

// One chunk, tile by tile through an L1-resident fp32 buffer. Returns whether any element was
// inf or NaN (tested before scaling, as torch does).
MIXPREC_CPU_CLONES bool unscale_chunk(DType in_type, const void* in, DType out_type, void* out, int64_t begin,
                                      int64_t n, const float* inv_scale) {
  alignas(64) float buf[cpu::kTile];
  bool bad = false;
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t m = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(in_type, in, at, m, buf);
    bad |= cpu::tile_has_non_finite(buf, m);
    if (out == nullptr) continue;
    const float s = inv_scale != nullptr ? *inv_scale : 1.f;
    for (int64_t i = 0; i < m; ++i) buf[i] *= s;
    cpu::store_tile(out_type, buf, out, at, m);
  }
  return bad;
}

}  // namespace

void non_finite_check_and_unscale_cpu(const UnscaleParams& p, int64_t chunk_begin, int64_t chunk_end) {
  const TensorGroup& g = *p.group;
  const bool write = g.num_lists == 2;
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef c = resolve_chunk(g, chunk);
    const bool bad = unscale_chunk(g.dtypes[0], g.ptrs[0][c.tensor], write ? g.dtypes[1] : g.dtypes[0],
                                   write ? g.ptrs[1][c.tensor] : nullptr, c.begin, c.size, p.inv_scale);
    if (bad) {
      // Several threads may store the same 1.f; plain stores of one value are what the CUDA
      // kernel does too, and every reader runs after the parallel region has joined.
      if (p.found_inf != nullptr) *p.found_inf = 1.f;
      if (p.per_tensor_found != nullptr) p.per_tensor_found[g.index[c.tensor]] = 1.f;
    }
  }
}

void update_scale_cpu(const ScaleUpdateParams& p) { update_scale_step(p); }

}  // namespace mixprec::kernels
