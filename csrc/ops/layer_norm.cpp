// Validation and kernel-tier packing for layer_norm_forward / layer_norm_backward (see
// kernels/layer_norm.h). Every check runs before any output is allocated or kernel launched.
#include "ops/layer_norm.h"

#include <c10/core/DeviceGuard.h>

#include <climits>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

constexpr const char* kForward = "layer_norm_forward";
constexpr const char* kBackward = "layer_norm_backward";

void check_rows(const char* op, const char* arg, const at::Tensor& t) {
  const std::string what = arg_name(op, arg);
  MIXPREC_CHECK(t.defined(), what, " is undefined");
  kernel_dtype(t, what);
  MIXPREC_CHECK_VALUE(t.dim() == 2, what, " must be 2-D [rows, normalized size], got shape ", shape(t.sym_sizes()));
  MIXPREC_CHECK(t.is_contiguous(), what, " is not contiguous; mixprec's layer_norm reads rows in place");
  // The kernels index a row's columns with int.
  MIXPREC_CHECK_VALUE(t.sym_size(1) <= INT_MAX, what, " has shape ", shape(t.sym_sizes()),
                      "; the normalized size must be below 2^31");
}

// weight or bias: [cols], input's dtype and device, contiguous.
void check_param(const char* op, const char* arg, const std::optional<at::Tensor>& t, const at::Tensor& input) {
  if (!t.has_value() || !t->defined()) return;
  const std::string what = arg_name(op, arg);
  MIXPREC_CHECK_VALUE(t->dim() == 1 && t->sym_size(0) == input.sym_size(1), what, " must have shape [",
                      num(input.sym_size(1)), "] (the normalized size), got ", shape(t->sym_sizes()));
  MIXPREC_CHECK_TYPE(t->scalar_type() == input.scalar_type(), what, " is ", t->scalar_type(), " but input is ",
                     input.scalar_type(), "; both must have one dtype");
  MIXPREC_CHECK(t->device() == input.device(), what, " is on ", t->device(), " but input is on ", input.device());
  MIXPREC_CHECK(t->is_contiguous(), what, " is not contiguous");
}

// One fp32 value per row of input, on its device.
void check_stat(const char* arg, const at::Tensor& t, const at::Tensor& input) {
  const std::string what = arg_name(kBackward, arg);
  MIXPREC_CHECK(t.defined(), what, " is undefined");
  MIXPREC_CHECK_TYPE(t.scalar_type() == at::kFloat, what, " must be float32 (layer_norm_forward's), got ",
                     t.scalar_type());
  MIXPREC_CHECK_VALUE(t.dim() == 1 && t.sym_size(0) == input.sym_size(0), what, " must have shape [",
                      num(input.sym_size(0)), "] (one value per row of input), got ", shape(t.sym_sizes()));
  MIXPREC_CHECK(t.device() == input.device(), what, " is on ", t.device(), " but input is on ", input.device());
  MIXPREC_CHECK(t.is_contiguous(), what, " is not contiguous");
}

const void* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

}  // namespace

void check_layer_norm_forward(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias) {
  check_rows(kForward, "input", input);
  check_param(kForward, "weight", weight, input);
  check_param(kForward, "bias", bias, input);
}

void check_layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
                               const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  check_rows(kBackward, "input", input);
  check_rows(kBackward, "grad_out", grad_out);
  MIXPREC_CHECK_TYPE(grad_out.scalar_type() == input.scalar_type(), arg_name(kBackward, "grad_out"), " is ",
                     grad_out.scalar_type(), " but input is ", input.scalar_type(), "; both must have one dtype");
  MIXPREC_CHECK(grad_out.device() == input.device(), arg_name(kBackward, "grad_out"), " is on ", grad_out.device(),
                " but input is on ", input.device());
  MIXPREC_CHECK_VALUE(grad_out.sym_sizes() == input.sym_sizes(), arg_name(kBackward, "grad_out"), " has shape ",
                      shape(grad_out.sym_sizes()), " but input has shape ", shape(input.sym_sizes()));
  check_stat("mean", mean, input);
  check_stat("rstd", rstd, input);
  check_param(kBackward, "weight", weight, input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_impl(const at::Tensor& input,
                                                                       const std::optional<at::Tensor>& weight,
                                                                       const std::optional<at::Tensor>& bias,
                                                                       double eps, const LayerNormRunners& runners) {
  check_layer_norm_forward(input, weight, bias);
  const int64_t rows = input.size(0), cols = input.size(1);
  at::Tensor out = at::empty_like(input);
  at::Tensor mean = at::empty({rows}, input.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, input.options().dtype(at::kFloat));
  if (rows == 0) return {out, mean, rstd};
  if (cols == 0) {  // torch's answer for an empty row: NaN statistics, nothing to write
    mean.fill_(NAN);
    rstd.fill_(NAN);
    return {out, mean, rstd};
  }
  const c10::DeviceGuard guard(input.device());
  kernels::LayerNormForwardParams p;
  p.dtype = kernel_dtype(input, arg_name(kForward, "input"));
  p.input = input.data_ptr();
  p.weight = ptr_or_null(weight);
  p.bias = ptr_or_null(bias);
  p.rows = rows;
  p.cols = cols;
  p.eps = static_cast<float>(eps);
  p.out = out.data_ptr();
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  runners.forward(p);
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, std::array<bool, 3> output_mask, const LayerNormRunners& runners) {
  check_layer_norm_backward(grad_out, input, mean, rstd, weight);
  const int64_t rows = input.size(0), cols = input.size(1);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty_like(input);
  if (output_mask[1]) grad_weight = at::empty({cols}, input.options());
  if (output_mask[2]) grad_bias = at::empty({cols}, input.options());
  if (cols == 0) return {grad_input, grad_weight, grad_bias};
  const c10::DeviceGuard guard(input.device());
  kernels::LayerNormBackwardParams p;
  p.dtype = kernel_dtype(input, arg_name(kBackward, "input"));
  p.grad_out = grad_out.data_ptr();
  p.input = input.data_ptr();
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.weight = ptr_or_null(weight);
  p.rows = rows;
  p.cols = cols;
  p.grad_input = output_mask[0] ? grad_input.data_ptr() : nullptr;
  p.grad_weight = output_mask[1] ? grad_weight.data_ptr() : nullptr;
  p.grad_bias = output_mask[2] ? grad_bias.data_ptr() : nullptr;
  at::Tensor partials;
  if (output_mask[1] || output_mask[2]) {
    p.splits = runners.splits(p.dtype, rows, cols);
    partials = at::empty({2, p.splits, cols}, input.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  if (rows == 0 && p.partials == nullptr) return {grad_input, grad_weight, grad_bias};
  runners.backward(p);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace mixprec::detail
