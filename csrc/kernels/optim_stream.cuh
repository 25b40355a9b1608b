// The streaming skeleton of the fused optimizer kernels on CUDA: loads, the unscaled-grad
// write-back, the per-element update and the stores over the vector groups of a chunk, written
// once; a family supplies its list roles, its vector shape and its per-element update.
#pragma once

#include <utility>

#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.cuh"

namespace mixprec::kernels {

// One optimizer-state list as the skeleton streams it: its index in the family's lists, and
// whether this chunk reads and writes it. Run-time flags (the skeleton branches around the
// access, never inside the update): SGD's first step writes the momentum without reading it,
// SGD without momentum touches neither, Adam's max_exp_avg_sq exists with amsgrad only. A list
// not read enters the update as zeros.
struct StateRole {
  int list;
  bool read = true;
  bool write = true;
  // An unread list enters the update as zeros (SGD's first step needs them); false leaves its
  // registers unset, for a list the update then ignores (Adam's max_exp_avg_sq without amsgrad):
  // the zeroing moves cost spills there.
  bool zero_unread = true;
};

// What a pass streams besides its states (bits of OptimStream's kFlags).
enum StreamFlags : int {
  kStreamPacked = 1,      // every access through load_packed/store_packed (Adam's choice, multi_tensor.cuh)
  kStreamNoGrad = 2,      // the gradient is not read (LAMB's apply pass)
  kStreamKeepWeight = 4,  // the weight is read, never written (LAMB's norms pass)
};

// A family's streaming shape. TP: model param storage, TG: grad storage, TS: storage of every
// state list; N elements per vector and Ilp vectors per thread in flight (each family's register
// budget: see the comments at each op); kPath: the weight path (WeightPath); kStoreGrad:
// stores_unscaled_grads (an instance of its own, so steps without a grad_scale keep their registers).
template <typename TP, typename TG, typename TS, int N, int Ilp, int kPath, bool kStoreGrad, int kFlags = 0>
struct OptimStream {
  static constexpr bool kPacked = (kFlags & kStreamPacked) != 0;
  static constexpr bool kReadGrad = (kFlags & kStreamNoGrad) == 0;
  static constexpr bool kWriteWeight = (kFlags & kStreamKeepWeight) == 0;

  // Streams one chunk: for every element, update(i, g, w, s_0, ..., s_{K-1}) with i the element's
  // index in the chunk (lanes past ctx.n hold zeros: an update that reduces must skip them), g the
  // gradient as stored (the update leaves it unscaled; unused without a grad), w the fp32 weight
  // and s_k state k, all fp32 references the update changes in place. The order is the one the
  // hand-written kernels had, which keeps registers low: every load of the Ilp vectors, then the
  // unscaled-grad write-back from a temporary (nothing holds it across the update), then the
  // update loop, then the weight's and the states' stores.
  template <int NLists, int K, typename Update>
  __device__ __forceinline__ static void run(const TensorTable<NLists>& table, const ChunkCtx& ctx,
                                             const WeightMode& weights, const StepScalars& scalars, int param_list,
                                             int grad_list, float inv_scale, const StateRole (&roles)[K],
                                             Update&& update) {
    static_assert(K >= 1, "a family streams at least one state list");
    TP* param = chunk_ptr<TP>(table, ctx, param_list);  // a constant: weights.param_list is read at run time
    TG* grad = chunk_ptr<TG>(table, ctx, grad_list);
    TS* state[K];
#pragma unroll
    for (int k = 0; k < K; ++k) state[k] = chunk_ptr<TS>(table, ctx, roles[k].list);
    void* master = master_chunk<kPath>(weights, table, ctx);  // fp32 masters or 16-bit remainders
    const int n = ctx.n;
    [[maybe_unused]] const uint32_t key = chunk_rounding_key<kPath>(weights, scalars, ctx);  // stochastic only
    const bool vec = ctx.vec_ok;
    for_each_vector_group<N, Ilp>(n, [&](int64_t base, int stride) {
      float g[Ilp][N], w[Ilp][N], s[K][Ilp][N];
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        if constexpr (kReadGrad) load_as<kPacked, TG, N>(grad, i, n, vec, g[u]);
        load_weight<kPacked, kPath, TP, N>(weights, param, master, i, n, vec, w[u]);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (roles[k].read) load_as<kPacked, TS, N>(state[k], i, n, vec, s[k][u]);
          else if (roles[k].zero_unread)
#pragma unroll
            for (int j = 0; j < N; ++j) s[k][u][j] = 0.f;
        }
      }
      if constexpr (kReadGrad && kStoreGrad) store_unscaled_grads<kPacked>(grad, base, stride, n, vec, inv_scale, g);
#pragma unroll
      for (int u = 0; u < Ilp; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j)
          apply(update, base + u * stride + j, g[u][j], w[u][j], s, u, j, std::make_index_sequence<K>{});
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        if constexpr (kWriteWeight)
          store_weight<kPacked, kPath, TP, N>(weights, key, ctx.begin, param, master, i, n, vec, w[u]);
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (roles[k].write) store_as<kPacked, TS, N>(state[k], i, n, vec, s[k][u]);
      }
    });
  }

 private:
  template <typename Update, int K, size_t... Ks>
  __device__ __forceinline__ static void apply(Update& update, int64_t i, float& g, float& w, float (&s)[K][Ilp][N],
                                               int u, int j, std::index_sequence<Ks...>) {
    update(i, g, w, s[Ks][u][j]...);
  }
};

}  // namespace mixprec::kernels
