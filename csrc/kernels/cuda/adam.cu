// Host launcher of the fused Adam/AdamW step on CUDA: dtype dispatch over kernels/adam.cuh.
#include "kernels/adam.cuh"

namespace mixprec::kernels {

void adam_cuda(const AdamParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[kAdamParam], [&](auto param_tag) {
    using TP = decltype(param_tag);
    dispatch_dtype(g.dtypes[kAdamGrad], [&](auto grad_tag) {
      using TG = decltype(grad_tag);
      // Moments are float32, bfloat16 or 8-bit codes (validated by the ops tier).
      dispatch_store_grads(p.scalars, [&](auto store) {
        constexpr bool kStore = decltype(store)::value;
        dispatch_weight_path<TP>(p.weights, [&](auto path) {
          constexpr int kPath = decltype(path)::value;
          if (p.quant8)  // 8-bit codes and their scales: kAdamQ8Lists lists
            launch_multi_tensor<kAdamQ8Lists>(g, AdamQ8Op<TP, TG, kStore, kPath>{p}, stream);
          else if (g.dtypes[kAdamExpAvg] == DType::kBFloat16)
            launch_multi_tensor<kAdamLists>(g, AdamOp<TP, TG, __nv_bfloat16, kStore, kPath>{p}, stream);
          else launch_multi_tensor<kAdamLists>(g, AdamOp<TP, TG, float, kStore, kPath>{p}, stream);
        });
      });
    });
  });
}

}  // namespace mixprec::kernels
