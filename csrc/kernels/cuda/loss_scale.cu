// Host launchers of the CUDA loss-scaling kernels: dtype dispatch over the device code in
// kernels/loss_scale.cuh, through the shared multi-tensor launcher.
#include "kernels/loss_scale.cuh"

namespace mixprec::kernels {

void non_finite_check_and_unscale_cuda(const UnscaleParams& p, Stream stream) {
  const TensorGroup& g = *p.group;
  if (g.size() == 0) return;
  dispatch_dtype(g.dtypes[0], [&](auto in_tag) {
    using TIn = decltype(in_tag);
    if (g.num_lists == 1) {
      launch_multi_tensor<1>(g, UnscaleOp<1, TIn, TIn>{p.found_inf, p.inv_scale, p.per_tensor_found}, stream);
      return;
    }
    dispatch_dtype(g.dtypes[1], [&](auto out_tag) {
      using TOut = decltype(out_tag);
      launch_multi_tensor<2>(g, UnscaleOp<2, TIn, TOut>{p.found_inf, p.inv_scale, p.per_tensor_found}, stream);
    });
  });
}

__global__ void update_scale_kernel(const ScaleUpdateParams p) { update_scale_step(p); }

void update_scale_cuda(const ScaleUpdateParams& p, Stream stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(p);
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mixprec::kernels
