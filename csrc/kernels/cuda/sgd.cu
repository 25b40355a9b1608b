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
        dispatch_weight_path<TP>(p.weights, [&](auto path) {
          launch_multi_tensor<kSgdLists>(g, SgdOp<TP, TG, decltype(store)::value, decltype(path)::value>{p}, stream);
        });
      });
    });
  });
}

}  // namespace mixprec::kernels
