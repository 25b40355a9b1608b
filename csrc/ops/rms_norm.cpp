// Validation and kernel-tier packing for rms_norm_forward / rms_norm_backward (see
// kernels/rms_norm.h). Every check runs before any output is allocated or kernel launched.
#include "ops/rms_norm.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/accumulate.h>

#include <climits>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

constexpr const char* kForward = "rms_norm_forward";
constexpr const char* kBackward = "rms_norm_backward";

bool same_shape(c10::SymIntArrayRef sizes, at::IntArrayRef want) {
  if (sizes.size() != want.size()) return false;
  for (size_t d = 0; d < want.size(); ++d)
    if (sizes[d] != want[d]) return false;
  return true;
}

// input or grad_out: a kernel dtype, contiguous, ending in normalized_shape.
void check_rows(const char* op, const char* arg, const at::Tensor& t, at::IntArrayRef normalized_shape) {
  const std::string what = arg_name(op, arg);
  MIXPREC_CHECK(t.defined(), what, " is undefined");
  kernel_dtype(t, what);
  const auto dims = static_cast<int64_t>(normalized_shape.size());
  MIXPREC_CHECK_VALUE(dims >= 1, arg_name(op, "normalized_shape"), " must have at least one dimension");
  MIXPREC_CHECK_VALUE(t.dim() >= dims && same_shape(t.sym_sizes().slice(t.dim() - dims), normalized_shape), what,
                      " has shape ", shape(t.sym_sizes()), "; its last dimensions must be normalized_shape ",
                      shape(normalized_shape));
  MIXPREC_CHECK(t.is_contiguous(), what, " is not contiguous; mixprec's rms_norm reads rows in place");
  // The kernels index a row's columns with int.
  MIXPREC_CHECK_VALUE(c10::multiply_integers(normalized_shape) <= INT_MAX, arg_name(op, "normalized_shape"), " ",
                      shape(normalized_shape), " has more than 2^31 - 1 elements");
}

// weight: normalized_shape, input's dtype or float32 (an fp32 weight for fp16/bf16 inputs, as
// Apex's MixedFusedRMSNorm), input's device, contiguous.
void check_weight(const char* op, const std::optional<at::Tensor>& t, const at::Tensor& input,
                  at::IntArrayRef normalized_shape) {
  if (!t.has_value() || !t->defined()) return;
  const std::string what = arg_name(op, "weight");
  MIXPREC_CHECK_VALUE(same_shape(t->sym_sizes(), normalized_shape), what, " must have shape ", "normalized_shape ",
                      shape(normalized_shape), ", got ", shape(t->sym_sizes()));
  MIXPREC_CHECK_TYPE(t->scalar_type() == input.scalar_type() || t->scalar_type() == at::kFloat, what, " is ",
                     t->scalar_type(), " but input is ", input.scalar_type(), "; expected ", input.scalar_type(),
                     " or float32");
  MIXPREC_CHECK(t->device() == input.device(), what, " is on ", t->device(), " but input is on ", input.device());
  MIXPREC_CHECK(t->is_contiguous(), what, " is not contiguous");
}

const void* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

kernels::DType weight_dtype(const std::optional<at::Tensor>& weight, kernels::DType input) {
  return weight.has_value() && weight->defined() ? kernel_dtype(*weight, "weight") : input;
}

}  // namespace

std::vector<c10::SymInt> rms_norm_stat_shape(const at::Tensor& input, at::IntArrayRef normalized_shape) {
  const auto sizes = input.sym_sizes();
  return std::vector<c10::SymInt>(sizes.begin(), sizes.end() - static_cast<int64_t>(normalized_shape.size()));
}

void check_rms_norm_forward(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight) {
  check_rows(kForward, "input", input, normalized_shape);
  check_weight(kForward, weight, input, normalized_shape);
}

void check_rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
                             const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  check_rows(kBackward, "input", input, normalized_shape);
  check_rows(kBackward, "grad_out", grad_out, normalized_shape);
  const std::string g = arg_name(kBackward, "grad_out");
  MIXPREC_CHECK_TYPE(grad_out.scalar_type() == input.scalar_type(), g, " is ", grad_out.scalar_type(), " but input is ",
                     input.scalar_type(), "; both must have one dtype");
  MIXPREC_CHECK(grad_out.device() == input.device(), g, " is on ", grad_out.device(), " but input is on ",
                input.device());
  MIXPREC_CHECK_VALUE(grad_out.sym_sizes() == input.sym_sizes(), g, " has shape ", shape(grad_out.sym_sizes()),
                      " but input has shape ", shape(input.sym_sizes()));
  const std::string r = arg_name(kBackward, "rstd");
  MIXPREC_CHECK(rstd.defined(), r, " is undefined");
  MIXPREC_CHECK_TYPE(rstd.scalar_type() == at::kFloat, r, " must be float32 (rms_norm_forward's), got ",
                     rstd.scalar_type());
  const auto stat = rms_norm_stat_shape(input, normalized_shape);
  MIXPREC_CHECK_VALUE(rstd.sym_sizes() == c10::SymIntArrayRef(stat), r, " must have shape ",
                      shape(c10::SymIntArrayRef(stat)), " (input's dimensions before normalized_shape), got ",
                      shape(rstd.sym_sizes()));
  MIXPREC_CHECK(rstd.device() == input.device(), r, " is on ", rstd.device(), " but input is on ", input.device());
  MIXPREC_CHECK(rstd.is_contiguous(), r, " is not contiguous");
  check_weight(kBackward, weight, input, normalized_shape);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_impl(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight, double eps,
                                                         const RmsNormRunners& runners) {
  check_rms_norm_forward(input, normalized_shape, weight);
  const int64_t cols = c10::multiply_integers(normalized_shape);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  at::Tensor out = at::empty_like(input);
  at::Tensor rstd = at::empty_symint(rms_norm_stat_shape(input, normalized_shape), input.options().dtype(at::kFloat));
  if (cols == 0) {  // torch's answer for an empty row: a NaN statistic, nothing to write
    rstd.fill_(NAN);
    return {out, rstd};
  }
  if (rows == 0) return {out, rstd};
  const c10::DeviceGuard guard(input.device());
  kernels::RmsNormForwardParams p;
  p.dtype = kernel_dtype(input, arg_name(kForward, "input"));
  p.weight_dtype = weight_dtype(weight, p.dtype);
  p.input = input.data_ptr();
  p.weight = ptr_or_null(weight);
  p.rows = rows;
  p.cols = cols;
  p.eps = static_cast<float>(eps);
  p.out = out.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  runners.forward(p);
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_impl(const at::Tensor& grad_out, const at::Tensor& input,
                                                          at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                          const std::optional<at::Tensor>& weight,
                                                          std::array<bool, 2> output_mask,
                                                          const RmsNormRunners& runners) {
  check_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight);
  const bool has_weight = weight.has_value() && weight->defined();
  const int64_t cols = c10::multiply_integers(normalized_shape);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  at::Tensor grad_input, grad_weight;
  if (output_mask[0]) grad_input = at::empty_like(input);
  // The weight's gradient in the weight's dtype (float32 for Apex's mixed form); without a
  // weight, in input's dtype (the gradient an all-ones weight of that dtype would get).
  if (output_mask[1]) grad_weight = at::empty(normalized_shape, has_weight ? weight->options() : input.options());
  if (cols == 0) return {grad_input, grad_weight};
  const c10::DeviceGuard guard(input.device());
  kernels::RmsNormBackwardParams p;
  p.dtype = kernel_dtype(input, arg_name(kBackward, "input"));
  p.weight_dtype = output_mask[1] ? kernel_dtype(grad_weight, "grad_weight") : weight_dtype(weight, p.dtype);
  p.grad_out = grad_out.data_ptr();
  p.input = input.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  p.weight = ptr_or_null(weight);
  p.rows = rows;
  p.cols = cols;
  p.grad_input = output_mask[0] ? grad_input.data_ptr() : nullptr;
  p.grad_weight = output_mask[1] ? grad_weight.data_ptr() : nullptr;
  at::Tensor partials;
  if (output_mask[1]) {
    p.splits = runners.splits(p.dtype, rows, cols);
    partials = at::empty({p.splits, cols}, input.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  if (rows == 0 && p.partials == nullptr) return {grad_input, grad_weight};
  runners.backward(p);
  return {grad_input, grad_weight};
}

}  // namespace mixprec::detail
