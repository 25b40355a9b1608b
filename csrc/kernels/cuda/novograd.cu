// Host launchers of the fused NovoGrad step on CUDA: the per-tensor moment update and the
// element-wise pass with dtype dispatch over kernels/novograd.cuh.
#include "kernels/novograd.cuh"

namespace mixprec::kernels {

void novograd_moment_cuda(const NovoGradMomentParams& p, Stream stream) {
  if (p.num_tensors == 0) return;
  const int64_t blocks = (p.num_tensors + kNovoGradMomentThreads - 1) / kNovoGradMomentThreads;
  novograd_moment_kernel<<<static_cast<unsigned>(blocks), kNovoGradMomentThreads, 0, stream>>>(p);
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

void novograd_cuda(const NovoGradParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[kNovoGradParam], [&](auto param_tag) {
    using TP = decltype(param_tag);
    dispatch_dtype(g.dtypes[kNovoGradGrad], [&](auto grad_tag) {
      dispatch_store_grads(p.scalars, [&](auto store) {
        dispatch_weight_path<TP>(p.weights, [&](auto path) {
          launch_multi_tensor<kNovoGradLists>(
              g, NovoGradOp<TP, decltype(grad_tag), decltype(store)::value, decltype(path)::value>{p}, stream);
        });
      });
    });
  });
}

}  // namespace mixprec::kernels
