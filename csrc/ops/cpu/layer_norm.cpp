// CPU registration of layer_norm_forward / layer_norm_backward: rows (forward), row splits and
// then column ranges (backward) over ATen's thread pool (the runners RMSNorm's CPU backend shares).
#include <torch/library.h>

#include "ops/layer_norm.h"
#include "ops/layer_norm_runners.h"

namespace mixprec::detail {
namespace {

using Cpu = CpuRowNormRunners<kernels::LayerNormForwardParams, kernels::LayerNormBackwardParams,
                              kernels::layer_norm_forward_cpu, kernels::layer_norm_backward_cpu,
                              kernels::layer_norm_param_grads_finish_cpu>;
constexpr LayerNormRunners kRunners{Cpu::forward, Cpu::splits, Cpu::backward};

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_with<kRunners>);
  m.impl("layer_norm_backward", &layer_norm_backward_with<kRunners>);
}

}  // namespace mixprec::detail
