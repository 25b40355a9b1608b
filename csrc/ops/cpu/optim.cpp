// CPU registration of the fused optimizer ops: each pass's chunks spread over ATen's thread pool;
// the per-tensor steps (norm finalize, NovoGrad's moments, the step count) run inline.
#include <ATen/Parallel.h>

#include "ops/optim.h"

namespace mixprec::detail {
namespace {

// Runs kernel(p, chunk_begin, chunk_end) over the chunks of p's group in parallel.
template <class Params, void (*Kernel)(const Params&, int64_t, int64_t)> void parallel(const Params& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { Kernel(p, b, e); });
}

const NormRunners kNorm{parallel<kernels::NormParams, kernels::norm_partials_cpu>, kernels::norm_finalize_cpu};
const AdamRunners kAdam{kernels::increment_step_cpu, parallel<kernels::AdamParams, kernels::adam_cpu>};
const SgdRunners kSgd{kernels::increment_step_cpu, parallel<kernels::SgdParams, kernels::sgd_cpu>};
const LambRunners kLamb{kernels::increment_step_cpu, parallel<kernels::LambParams, kernels::lamb_moments_cpu>,
                        parallel<kernels::LambParams, kernels::lamb_apply_cpu>, kNorm};
const AdagradRunners kAdagrad{kernels::increment_step_cpu, parallel<kernels::AdagradParams, kernels::adagrad_cpu>};
const NovoGradRunners kNovoGrad{kNorm, kernels::increment_step_cpu, kernels::novograd_moment_cpu,
                                parallel<kernels::NovoGradParams, kernels::novograd_cpu>};

}  // namespace
}  // namespace mixprec::detail

MIXPREC_REGISTER_OPTIM(adam, CPU, mixprec::detail::kAdam)
MIXPREC_REGISTER_OPTIM(sgd, CPU, mixprec::detail::kSgd)
MIXPREC_REGISTER_OPTIM(lamb, CPU, mixprec::detail::kLamb)
MIXPREC_REGISTER_OPTIM(adagrad, CPU, mixprec::detail::kAdagrad)
MIXPREC_REGISTER_OPTIM(novograd, CPU, mixprec::detail::kNovoGrad)
