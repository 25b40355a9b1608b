// CPU kernels of the multi-tensor norm: per-chunk partials (fp32 lanes, vectorized), then
// per-tensor and total norms reduced from the partials in a fixed order.
#include "kernels/norm.h"

#include <cmath>

#include "kernels/cpu/convert.h"

namespace mixprec::kernels {
namespace {

constexpr int kLanes = 16;  // independent accumulators: two AVX2 registers' worth

MIXPREC_INLINE float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

MIXPREC_CPU_CLONES float norm_chunk(DType type, const void* in, int64_t begin, int64_t n, NormType norm) {
  alignas(64) float buf[cpu::kTile];
  float acc[kLanes] = {};
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t m = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(type, in, at, m, buf);
    for (int64_t i = m; i < (m + kLanes - 1) / kLanes * kLanes; ++i) buf[i] = 0.f;  // pad the last lanes
    const int64_t padded = (m + kLanes - 1) / kLanes * kLanes;
    if (norm == NormType::kL2) {
      for (int64_t i = 0; i < padded; i += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += buf[i + l] * buf[i + l];
    } else {
      for (int64_t i = 0; i < padded; i += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] = nan_max(acc[l], std::fabs(buf[i + l]));
    }
  }
  float r = acc[0];
  for (int l = 1; l < kLanes; ++l) r = norm == NormType::kL2 ? r + acc[l] : nan_max(r, acc[l]);
  return r;
}

float reduce_partials(NormType type, const float* partials, int64_t begin, int64_t end) {
  double sum = 0.0;  // the few partials are summed in double: cheap, and order-independent enough
  float mx = 0.f;
  for (int64_t i = begin; i < end; ++i) {
    if (type == NormType::kL2) sum += partials[i];
    else mx = nan_max(mx, partials[i]);
  }
  return type == NormType::kL2 ? static_cast<float>(std::sqrt(sum)) : mx;
}

}  // namespace

void norm_partials_cpu(const NormParams& p, int64_t chunk_begin, int64_t chunk_end) {
  const TensorGroup& g = *p.group;
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef c = resolve_chunk(g, chunk);
    p.partials[g.first_chunk[c.tensor] + (chunk - g.chunk_prefix[c.tensor])] =
        norm_chunk(g.dtypes[0], g.ptrs[0][c.tensor], c.begin, c.size, p.type);
  }
}

void norm_finalize_cpu(const NormFinalizeParams& p) {
  if (p.per_tensor != nullptr) {
    const TensorGroup& all = *p.all;
    for (int64_t i = 0; i < all.size(); ++i)
      p.per_tensor[all.index[i]] =
          reduce_partials(p.type, p.partials, all.first_chunk[i], all.first_chunk[i] + num_chunks(all.numel[i]));
  }
  *p.total = reduce_partials(p.type, p.partials, 0, p.total_chunks);
}

}  // namespace mixprec::kernels
