// Host launcher of the fused Adagrad step on CUDA: dtype dispatch over kernels/adagrad.cuh.
#include "kernels/adagrad.cuh"

namespace mixprec::kernels {

void adagrad_cuda(const AdagradParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[kAdagradParam], [&](auto param_tag) {
    using TP = decltype(param_tag);
    dispatch_dtype(g.dtypes[kAdagradGrad], [&](auto grad_tag) {
      using TG = decltype(grad_tag);
      dispatch_store_grads(p.scalars, [&](auto store) {
        dispatch_weight_path<TP>(p.weights, [&](auto path) {
          launch_multi_tensor<kAdagradLists>(g, AdagradOp<TP, TG, decltype(store)::value, decltype(path)::value>{p},
                                             stream);
        });
      });
    });
  });
}

}  // namespace mixprec::kernels
