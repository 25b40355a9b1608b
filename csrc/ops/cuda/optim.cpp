// CUDA registration of the fused optimizer ops: every pass (norms, step increment, moments,
// update) queued on the current stream, with no host synchronization.
#include <ATen/cuda/CUDAContext.h>

#include "ops/optim.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Runs kernel(p, stream) on the current stream: a runner of the type the impls call.
template <class Params, void (*Kernel)(const Params&, kernels::Stream)> void on_stream(const Params& p) {
  Kernel(p, current_stream());
}

void increment_step(float* step_tensor, const float* found_inf) {
  kernels::increment_step_cuda(step_tensor, found_inf, current_stream());
}

const NormRunners kNorm{on_stream<kernels::NormParams, kernels::norm_partials_cuda>,
                        on_stream<kernels::NormFinalizeParams, kernels::norm_finalize_cuda>};
const AdamRunners kAdam{increment_step, on_stream<kernels::AdamParams, kernels::adam_cuda>};
const SgdRunners kSgd{increment_step, on_stream<kernels::SgdParams, kernels::sgd_cuda>};
const LambRunners kLamb{increment_step, on_stream<kernels::LambParams, kernels::lamb_moments_cuda>,
                        on_stream<kernels::LambParams, kernels::lamb_apply_cuda>, kNorm};
const AdagradRunners kAdagrad{increment_step, on_stream<kernels::AdagradParams, kernels::adagrad_cuda>};
const NovoGradRunners kNovoGrad{kNorm, increment_step,
                                on_stream<kernels::NovoGradMomentParams, kernels::novograd_moment_cuda>,
                                on_stream<kernels::NovoGradParams, kernels::novograd_cuda>};

}  // namespace
}  // namespace mixprec::detail

MIXPREC_REGISTER_OPTIM(adam, CUDA, mixprec::detail::kAdam)
MIXPREC_REGISTER_OPTIM(sgd, CUDA, mixprec::detail::kSgd)
MIXPREC_REGISTER_OPTIM(lamb, CUDA, mixprec::detail::kLamb)
MIXPREC_REGISTER_OPTIM(adagrad, CUDA, mixprec::detail::kAdagrad)
MIXPREC_REGISTER_OPTIM(novograd, CUDA, mixprec::detail::kNovoGrad)
