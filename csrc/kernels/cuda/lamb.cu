// Host launchers of the fused LAMB step on CUDA: dtype dispatch over kernels/lamb.cuh.
#include "kernels/lamb.cuh"

namespace mixprec::kernels {

void lamb_moments_cuda(const LambParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[kLambParam], [&](auto param_tag) {
    using TP = decltype(param_tag);
    dispatch_dtype(g.dtypes[kLambGrad], [&](auto grad_tag) {
      using TG = decltype(grad_tag);
      dispatch_store_grads(p.scalars, [&](auto store) {
        constexpr bool kStore = decltype(store)::value;
        // The two-pass moments read the weight too (its norm, the decay): remainders need their path.
        dispatch_weight_path<TP>(p.weights, [&](auto path) {
          constexpr int kPath = decltype(path)::value;
          if (p.trust_ratio) launch_multi_tensor<kLambLists>(g, LambMomentsOp<TP, TG, false, kStore, kPath>{p}, stream);
          else launch_multi_tensor<kLambLists>(g, LambMomentsOp<TP, TG, true, kStore, kPath>{p}, stream);
        });
      });
    });
  });
}

void lamb_apply_cuda(const LambParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[kLambParam], [&](auto param_tag) {
    using TP = decltype(param_tag);
    dispatch_weight_path<TP>(p.weights, [&](auto path) {
      launch_multi_tensor<kLambLists>(g, LambApplyOp<TP, decltype(path)::value>{p}, stream);
    });
  });
}

}  // namespace mixprec::kernels
