// CPU side of how every fused optimizer reads and writes the weight it updates (WeightMode,
// kernels/optim_common.h): one tile of fp32 weights in, the same tile out to param and master;
// and stream_tiles, the CPU twin of the CUDA streaming skeleton (kernels/optim_stream.cuh).
#pragma once

#include <algorithm>
#include <utility>

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

// One optimizer-state list as stream_tiles streams it (StateRole of kernels/optim_stream.cuh): its
// index in the family's lists, whether the chunk reads it (else it enters the update as zeros)
// and whether it writes it back; its dtype is the group's.
struct TileState {
  int list;
  bool read = true;
  bool write = true;
};

namespace detail {
template <int K, typename Update, size_t... Ks>
MIXPREC_INLINE void update_element(Update& update, float& g, float& w, float (&s)[K][kTile], int64_t i,
                                   std::index_sequence<Ks...>) {
  update(g, w, s[Ks][i]...);
}
}  // namespace detail

// Elements [begin, begin + n) of group tensor t through L1-sized fp32 tiles: loads (the gradient
// unless kReadGrad is false, the weight, the states), update(g, w, s_0, ..., s_{K-1}) on every
// element (fp32 references changed in place: g leaves unscaled), then the unscaled gradients
// under a grad_scale, the weight and the written states go back. The update loop is plain
// arithmetic over local tiles, which the compiler vectorizes inside the family's
// MIXPREC_CPU_CLONES function this is inlined into (the update must not capture coefficients
// through a reference the tiles' stores could alias: capture a local copy).
template <bool kReadGrad = true, int K, typename Update>
MIXPREC_INLINE void stream_tiles(const WeightMode& m, const StepScalars& s, const TensorGroup& g, int grad_list,
                                 const TileState (&roles)[K], int64_t t, int64_t begin, int64_t n, Update&& update) {
  alignas(64) float grad[kTile], w[kTile], st[K][kTile];
  for (int64_t at = begin; at < begin + n; at += kTile) {
    const int64_t len = std::min(kTile, begin + n - at);
    if constexpr (kReadGrad) load_tile(g.dtypes[grad_list], g.ptrs[grad_list][t], at, len, grad);
    load_weights(m, g, t, at, len, w);
    for (int k = 0; k < K; ++k) {
      if (roles[k].read) load_tile(g.dtypes[roles[k].list], g.ptrs[roles[k].list][t], at, len, st[k]);
      else std::fill(st[k], st[k] + len, 0.f);
    }
    for (int64_t i = 0; i < len; ++i)
      detail::update_element<K>(update, grad[i], w[i], st, i, std::make_index_sequence<K>{});
    if (kReadGrad && stores_unscaled_grads(s)) store_tile(g.dtypes[grad_list], grad, g.ptrs[grad_list][t], at, len);
    store_weights(m, s, g, t, at, len, w);
    for (int k = 0; k < K; ++k)
      if (roles[k].write) store_tile(g.dtypes[roles[k].list], st[k], g.ptrs[roles[k].list][t], at, len);
  }
}

}  // namespace mixprec::kernels::cpu
