// Host launcher of the fused SGD step on CUDA: dtype dispatch over kernels/sgd.cuh.
#include "kernels/sgd.cuh"

namespace mixprec::kernels {

void sgd_cuda(const SgdParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[kSgdParam], [&](auto param_tag) {
    using TP = decltype(param_tag);
    dispatch_dtype(g.dtypes[kSgdGrad], [&](auto grad_tag) {
      using TG = decltype(grad_tag);
      dispatch_store_grads(p.scalars, [&](auto store) {
        constexpr bool kStore = decltype(store)::value;
        dispatch_weight_path<TP>(p.weights, [&](auto path) {
          constexpr int kPath = decltype(path)::value;
          // Momentum is float32 or the param's dtype (validated by the ops tier). Without momentum
          // the list stands in with the params and is never touched: the float32 instance runs.
          if (p.args.momentum != 0 && g.dtypes[kSgdMomentum] != DType::kFloat32)
            launch_multi_tensor<kSgdLists>(g, SgdOp<TP, TG, TP, kStore, kPath>{p}, stream);
          else launch_multi_tensor<kSgdLists>(g, SgdOp<TP, TG, float, kStore, kPath>{p}, stream);
        });
      });
    });
  });
}

}  // namespace mixprec::kernels
