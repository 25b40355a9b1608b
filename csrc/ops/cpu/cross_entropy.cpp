// CPU registration of cross_entropy_forward / cross_entropy_backward: rows spread over ATen's
// thread pool, targets checked on the host before any kernel runs.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/cross_entropy.h"

namespace mixprec::detail {
namespace {

// About 32 Ki logits per task: short rows are batched so a task is worth its scheduling cost.
int64_t grain_rows(int64_t vocab) { return std::max<int64_t>(1, 32768 / vocab); }

void run_forward(const kernels::CrossEntropyForwardParams& p) {
  at::parallel_for(0, p.rows, grain_rows(p.vocab),
                   [&](int64_t b, int64_t e) { kernels::cross_entropy_forward_cpu(p, b, e); });
}

void run_backward(const kernels::CrossEntropyBackwardParams& p) {
  at::parallel_for(0, p.rows, grain_rows(p.vocab),
                   [&](int64_t b, int64_t e) { kernels::cross_entropy_backward_cpu(p, b, e); });
}

constexpr CrossEntropyRunners kRunners{run_forward, run_backward, /*check_target_values=*/true};

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_cpu(const at::Tensor& logits, const at::Tensor& target,
                                                             int64_t ignore_index) {
  return cross_entropy_forward_impl(logits, target, ignore_index, kRunners);
}

at::Tensor cross_entropy_backward_cpu(const at::Tensor& grad_losses, const at::Tensor& logits, const at::Tensor& target,
                                      const at::Tensor& lse, int64_t ignore_index) {
  return cross_entropy_backward_impl(grad_losses, logits, target, lse, ignore_index, kRunners);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) {
  m.impl("cross_entropy_forward", &cross_entropy_forward_cpu);
  m.impl("cross_entropy_backward", &cross_entropy_backward_cpu);
}

}  // namespace mixprec::detail
