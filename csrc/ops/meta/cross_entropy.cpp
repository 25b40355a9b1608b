// Meta registration of cross_entropy_forward / cross_entropy_backward: output shapes (symbolic
// under torch.compile) after the same argument checks the real kernels make.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/cross_entropy.h"

namespace mixprec::detail {
namespace {

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_meta(const at::Tensor& logits, const at::Tensor& target,
                                                              int64_t /*ignore_index*/) {
  check_cross_entropy_forward(logits, target);
  const auto opts = logits.options().dtype(at::kFloat);
  return {at::empty_symint({logits.sym_size(0)}, opts), at::empty_symint({logits.sym_size(0)}, opts)};
}

at::Tensor cross_entropy_backward_meta(const at::Tensor& grad_losses, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse, int64_t /*ignore_index*/) {
  check_cross_entropy_backward(grad_losses, logits, target, lse);
  return at::empty_symint(logits.sym_sizes(), logits.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) {
  m.impl("cross_entropy_forward", &cross_entropy_forward_meta);
  m.impl("cross_entropy_backward", &cross_entropy_backward_meta);
}

}  // namespace mixprec::detail
