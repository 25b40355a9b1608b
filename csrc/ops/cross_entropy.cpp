// Validation and kernel-tier packing for cross_entropy_forward / cross_entropy_backward (see
// cross_entropy.h). Every check runs before any output is allocated or any kernel is launched.
#include "ops/cross_entropy.h"

#include <c10/core/DeviceGuard.h>

#include <climits>
#include <string>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

constexpr const char* kForward = "cross_entropy_forward";
constexpr const char* kBackward = "cross_entropy_backward";

void check_logits(const char* op, const at::Tensor& logits) {
  const std::string what = arg_name(op, "logits");
  MIXPREC_CHECK(logits.defined(), what, " is undefined");
  kernel_dtype(logits, what);
  MIXPREC_CHECK_VALUE(logits.dim() == 2, what, " must be 2-D [N, V], got shape ", shape(logits.sym_sizes()));
  MIXPREC_CHECK_VALUE(logits.sym_size(1) >= 1, what, " has no classes (shape ", shape(logits.sym_sizes()), ")");
  MIXPREC_CHECK(logits.is_contiguous(), what, " is not contiguous; mixprec's cross_entropy reads rows in place");
}

// A [N] tensor beside logits [N, V]: same device, the given dtype, contiguous.
void check_row_vector(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& logits,
                      at::ScalarType dtype) {
  const std::string what = arg_name(op, arg);
  MIXPREC_CHECK(t.defined(), what, " is undefined");
  MIXPREC_CHECK(t.device() == logits.device(), what, " is on ", t.device().str(), " but logits is on ",
                logits.device().str());
  MIXPREC_CHECK_TYPE(t.scalar_type() == dtype, what, " has dtype ", t.scalar_type(), "; expected ", dtype);
  MIXPREC_CHECK_VALUE(t.dim() == 1 && t.sym_size(0) == logits.sym_size(0), what, " must have shape [N] = [",
                      num(logits.sym_size(0)), "] for logits of shape ", shape(logits.sym_sizes()), ", got ",
                      shape(t.sym_sizes()));
  MIXPREC_CHECK(t.is_contiguous(), what, " is not contiguous");
}

// The kernels index a row with int and launch one CUDA block per row.
void check_extent(const char* op, const at::Tensor& logits) {
  MIXPREC_CHECK_VALUE(logits.size(0) <= INT_MAX && logits.size(1) <= INT_MAX, arg_name(op, "logits"), " has shape ",
                      shape(logits.sizes()), "; N and V must each be below 2^31");
}

// Host-side look at every target (CPU only): the first one outside [0, V) that is not ignored.
void check_target_values(const char* op, const at::Tensor& target, int64_t ignore_index, int64_t vocab) {
  const int64_t* t = target.data_ptr<int64_t>();
  for (int64_t i = 0; i < target.numel(); ++i)
    MIXPREC_CHECK_INDEX(t[i] == ignore_index || kernels::target_in_range(t[i], vocab), arg_name(op, "target", i),
                        " is ", num(t[i]), ", outside [0, ", num(vocab), ") and not ignore_index (", num(ignore_index),
                        ")");
}

}  // namespace

void check_cross_entropy_forward(const at::Tensor& logits, const at::Tensor& target) {
  check_logits(kForward, logits);
  check_row_vector(kForward, "target", target, logits, at::kLong);
}

void check_cross_entropy_backward(const at::Tensor& grad_losses, const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse) {
  check_logits(kBackward, logits);
  check_row_vector(kBackward, "grad_losses", grad_losses, logits, at::kFloat);
  check_row_vector(kBackward, "target", target, logits, at::kLong);
  check_row_vector(kBackward, "lse", lse, logits, at::kFloat);
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_impl(const at::Tensor& logits, const at::Tensor& target,
                                                              int64_t ignore_index, const CrossEntropyRunners& run) {
  check_cross_entropy_forward(logits, target);
  check_extent(kForward, logits);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (run.check_target_values) check_target_values(kForward, target, ignore_index, vocab);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor losses = at::empty({rows}, opts);
  at::Tensor lse = at::empty({rows}, opts);
  if (rows == 0) return {losses, lse};

  const c10::DeviceGuard guard(logits.device());
  kernels::CrossEntropyForwardParams p;
  p.dtype = kernel_dtype(logits, arg_name(kForward, "logits"));
  p.logits = logits.data_ptr();
  p.target = target.data_ptr<int64_t>();
  p.rows = rows;
  p.vocab = vocab;
  p.ignore_index = ignore_index;
  p.losses = losses.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  run.forward(p);
  return {losses, lse};
}

at::Tensor cross_entropy_backward_impl(const at::Tensor& grad_losses, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                                       const CrossEntropyRunners& run) {
  check_cross_entropy_backward(grad_losses, logits, target, lse);
  check_extent(kBackward, logits);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (run.check_target_values) check_target_values(kBackward, target, ignore_index, vocab);
  at::Tensor grad_logits = at::empty(logits.sizes(), logits.options());
  if (rows == 0) return grad_logits;

  const c10::DeviceGuard guard(logits.device());
  kernels::CrossEntropyBackwardParams p;
  p.dtype = kernel_dtype(logits, arg_name(kBackward, "logits"));
  p.grad_losses = grad_losses.data_ptr<float>();
  p.logits = logits.data_ptr();
  p.target = target.data_ptr<int64_t>();
  p.lse = lse.data_ptr<float>();
  p.rows = rows;
  p.vocab = vocab;
  p.ignore_index = ignore_index;
  p.grad_logits = grad_logits.data_ptr();
  run.backward(p);
  return grad_logits;
}

}  // namespace mixprec::detail
