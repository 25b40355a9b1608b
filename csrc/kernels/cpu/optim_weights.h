// CPU side of how every fused optimizer reads and writes the weight it updates (WeightMode,
// kernels/optim_common.h): one tile of fp32 weights in, the same tile out to param and master.
#pragma once

#include "kernels/cpu/convert.h"
#include "kernels/optim_common.h"

namespace mixprec::kernels::cpu {

// Elements [at, at + len) of group tensor t as fp32 weights: the master (fp32, or rebuilt from
// the bf16 param and its remainder) when there is one, else the param.
MIXPREC_INLINE void load_weights(const WeightMode& m, const TensorGroup& g, int64_t t, int64_t at, int64_t len,
                                 float* w) {
  if (m.remainder) {
    const auto* high = static_cast<const uint16_t*>(g.ptrs[m.param_list][t]) + at;
    const auto* low = static_cast<const uint16_t*>(g.ptrs[m.master_list][t]) + at;
    for (int64_t i = 0; i < len; ++i) w[i] = rebuild_master(high[i], low[i]);
    return;
  }
  const int list = m.has_master ? m.master_list : m.param_list;
  load_tile(g.dtypes[list], g.ptrs[list][t], at, len, w);
}

// The updated weights back: split into (bf16 param, remainder), or rounded into the param (to
// nearest, or stochastically by the hash of (seed, step, tensor, element)) and kept whole in the
// fp32 master when there is one.
MIXPREC_INLINE void store_weights(const WeightMode& m, const StepScalars& s, const TensorGroup& g, int64_t t,
                                  int64_t at, int64_t len, const float* w) {
  auto* high = static_cast<uint16_t*>(g.ptrs[m.param_list][t]) + at;
  if (m.remainder) {
    auto* low = static_cast<uint16_t*>(g.ptrs[m.master_list][t]) + at;
    for (int64_t i = 0; i < len; ++i) split_master(w[i], high[i], low[i]);
    return;
  }
  if (m.stochastic) {
    const uint32_t key = rounding_key(m.seed, step_count(s), g.index[t]);
    for (int64_t i = 0; i < len; ++i) high[i] = bf16_round_stochastic(w[i], rounding_bits(key, at + i));
    return;
  }
  store_tile(g.dtypes[m.param_list], w, g.ptrs[m.param_list][t], at, len);
  if (m.has_master) store_tile(DType::kFloat32, w, g.ptrs[m.master_list][t], at, len);
}

}  // namespace mixprec::kernels::cpu
