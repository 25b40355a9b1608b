// CUDA side of the optimizers' shared pieces: the on-device step-count increment.
#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.h"

namespace mixprec::kernels {

__global__ void increment_step_kernel(float* step_tensor, const float* found_inf) {
  if (found_inf == nullptr || *found_inf == 0.f) *step_tensor += 1.f;
}

void increment_step_cuda(float* step_tensor, const float* found_inf, Stream stream) {
  increment_step_kernel<<<1, 1, 0, stream>>>(step_tensor, found_inf);
  MIXPREC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mixprec::kernels
