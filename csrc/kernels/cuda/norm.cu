// Host launchers of the CUDA multi-tensor norm (kernels/norm.cuh): partials, then finalize.
#include "kernels/norm.cuh"

namespace mixprec::kernels {

void norm_partials_cuda(const NormParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[0], [&](auto tag) {
    launch_multi_tensor<1>(g, NormPartialOp<decltype(tag)>{p.type, p.partials}, stream);
  });
}

void norm_finalize_cuda(const NormFinalizeParams& p, Stream stream) {
  if (p.per_tensor != nullptr) {
    for_each_table<0>(
        *p.all, [](int64_t) { return int64_t{1}; },
        [&](const TensorTable<0>& table, unsigned blocks) {
          norm_per_tensor_kernel<<<blocks, kBlockThreads, 0, stream>>>(table, p.type, p.partials, p.per_tensor);
          MIXPREC_CUDA_CHECK(cudaGetLastError());
        });
  }
  norm_total_kernel<<<1, kBlockThreads, 0, stream>>>(p.type, p.partials, p.total_chunks, p.total);
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mixprec::kernels
