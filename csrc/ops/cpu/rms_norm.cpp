// CPU registration of rms_norm_forward / rms_norm_backward: rows (forward), row splits and then
// column ranges (backward) over ATen's thread pool (the runners LayerNorm's CPU backend shares).
#include <torch/library.h>

#include "ops/layer_norm_runners.h"
#include "ops/rms_norm.h"

namespace mixprec::detail {
namespace {

using Cpu =
    CpuRowNormRunners<kernels::RmsNormForwardParams, kernels::RmsNormBackwardParams, kernels::rms_norm_forward_cpu,
                      kernels::rms_norm_backward_cpu, kernels::rms_norm_weight_grad_finish_cpu>;
constexpr RmsNormRunners kRunners{Cpu::forward, Cpu::splits, Cpu::backward};

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_with<kRunners>);
  m.impl("rms_norm_backward", &rms_norm_backward_with<kRunners>);
}

}  // namespace mixprec::detail
