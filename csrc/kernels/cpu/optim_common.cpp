// CPU side of the optimizers' shared pieces: the step-count increment.
#include "kernels/optim_common.h"

namespace mixprec::kernels {

void increment_step_cpu(float* step_tensor, const float* found_inf) {
  if (found_inf == nullptr || *found_inf == 0.f) *step_tensor += 1.f;
}

}  // namespace mixprec::kernels
