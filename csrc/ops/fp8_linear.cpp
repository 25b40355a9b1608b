// mixprec::fp8_linear: a Linear's three GEMMs on FP8 operands with per-tensor scales kept on the
// device, and its C++ autograd node: the one implementation behind python's Fp8Linear and C++'s
// fp8::Linear (docs/fp8.md). The casts and scale updates are the fp8_* ops (ops/fp8.cpp).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <mixprec/ops.h>  // the cast ops, called through the dispatcher (so torch.compile sees them)
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "ops/front_rules.h"  // fp8_dim_fits: the shape rule the fronts' fallbacks follow too
#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "fp8_linear";
enum Role : int64_t { kInput = 0, kWeight = 1, kGradOutput = 2 };

// The recipe as the op takes it (python: Fp8Recipe, C++: fp8::Recipe).
struct Spec {
  at::ScalarType forward_dtype, backward_dtype;
  bool delayed;
  double margin;
  std::string reduction;
  std::optional<std::string> group;  // the process group whose ranks agree on current scaling's amaxes
};

// One role's scale, amax and history: views of the state, so the casts update it in place.
struct Row {
  at::Tensor scale, amax, history;
};
Row row(const at::Tensor& scale, const at::Tensor& amax, const at::Tensor& history, int64_t role) {
  return {scale.narrow(0, role, 1), amax.narrow(0, role, 1), history.select(0, role)};
}

struct Cast {
  at::Tensor q, q_t, inv;  // FP8 values, their transpose (or undefined), the dequantization factor
};

bool is_real(const at::Tensor& t) {
  // Fake, functional and meta tensors have no memory whose overlap could be compared.
  return t.device().type() != at::kMeta &&
         !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

void check_state(const char* arg, const at::Tensor& t, const at::Tensor& input, int64_t dims, at::ScalarType dtype) {
  const std::string what = arg_name(kOp, arg);
  MIXPREC_CHECK(t.defined(), what, " is undefined");
  MIXPREC_CHECK(t.device() == input.device(), what, " is on ", t.device().str(), " but input is on ",
                input.device().str());
  MIXPREC_CHECK_TYPE(t.scalar_type() == dtype, what, " has dtype ", t.scalar_type(), "; expected ", dtype);
  MIXPREC_CHECK_VALUE(t.dim() == dims && t.sym_size(0) == 3 && t.is_contiguous() && (dims == 1 || t.sym_size(1) >= 1),
                      what, " must be contiguous of shape ",
                      dims == 1 ? "[3]" : (t.scalar_type() == at::kDouble ? "[3, 2]" : "[3, history_len >= 1]"),
                      " (rows: input, weight, grad_output), got ", shape(t.sym_sizes()));
}

// Every argument, before anything is written: a refused call changes nothing.
void check_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                const at::Tensor& scale, const at::Tensor& amax, const at::Tensor& history, const Spec& s,
                const std::optional<at::Tensor>& saturation) {
  MIXPREC_CHECK(input.defined() && weight.defined(), arg_name(kOp, input.defined() ? "weight" : "input"),
                " is undefined");
  kernel_dtype(input, arg_name(kOp, "input"));
  kernel_dtype(weight, arg_name(kOp, "weight"));
  MIXPREC_CHECK(weight.device() == input.device(), arg_name(kOp, "weight"), " is on ", weight.device().str(),
                " but input is on ", input.device().str());
  MIXPREC_CHECK_VALUE(weight.dim() == 2, arg_name(kOp, "weight"),
                      " must be 2-D [out_features, in_features], got shape ", shape(weight.sym_sizes()));
  const c10::SymInt n = weight.sym_size(0), k = weight.sym_size(1);
  MIXPREC_CHECK_VALUE(input.dim() >= 1 && input.sym_size(-1) == k, arg_name(kOp, "input"), " has shape ",
                      shape(input.sym_sizes()), "; its last dimension must be in_features = ", num(k));
  const c10::SymInt tokens = k == 0 ? c10::SymInt(0) : input.sym_numel() / k;
  MIXPREC_CHECK_VALUE(fp8_dim_fits(n) && fp8_dim_fits(k) && fp8_dim_fits(tokens), "mixprec::fp8_linear: out_features ",
                      num(n), ", in_features ", num(k), " and the token count ", num(tokens),
                      " (input's elements / in_features) must be positive multiples of ", num(kFp8Align),
                      " (torch._scaled_mm's tiles); run plain linear for other shapes");
  if (bias.has_value() && bias->defined()) {
    MIXPREC_CHECK(bias->device() == input.device(), arg_name(kOp, "bias"), " is on ", bias->device().str(),
                  " but input is on ", input.device().str());
    kernel_dtype(*bias, arg_name(kOp, "bias"));
    MIXPREC_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == n, arg_name(kOp, "bias"),
                        " must have shape [out_features] = [", num(n), "], got ", shape(bias->sym_sizes()));
  }
  check_state("scale", scale, input, 1, at::kFloat);
  check_state("amax", amax, input, 1, at::kFloat);
  check_state("amax_history", history, input, 2, at::kFloat);
  if (saturation.has_value()) check_state("saturation", *saturation, input, 2, at::kDouble);
  MIXPREC_CHECK_VALUE(!saturation.has_value() || saturation->sym_size(1) == 2, arg_name(kOp, "saturation"),
                      " must have shape [3, 2], got ", shape(saturation->sym_sizes()));
  fp8_format_of(kOp, "forward_dtype", s.forward_dtype);
  fp8_format_of(kOp, "backward_dtype", s.backward_dtype);
  MIXPREC_CHECK_VALUE(std::isfinite(s.margin) && s.margin >= 0 && s.margin <= 64, arg_name(kOp, "margin"),
                      " must be a finite number in [0, 64] (the scale is divided by 2^margin), got ", num(s.margin));
  MIXPREC_CHECK_VALUE(s.reduction == "max" || s.reduction == "most_recent", arg_name(kOp, "reduction"),
                      " must be 'max' or 'most_recent', got '", s.reduction, "'");
  MIXPREC_CHECK_VALUE(!s.group || !s.group->empty(), arg_name(kOp, "group_name"), " is empty; pass None for no group");
  if (is_real(scale) && is_real(amax) && is_real(history)) {
    for (const auto& [a, b, name] : {std::make_tuple(&amax, &history, "amax and amax_history"),
                                     std::make_tuple(&scale, &history, "scale and amax_history"),
                                     std::make_tuple(&scale, &amax, "scale and amax")})
      MIXPREC_CHECK_VALUE(at::get_overlap_status(*a, *b) == at::MemOverlapStatus::No, "mixprec::", kOp, ": ", name,
                          " share memory");
  }
}

// A collective of torch's functional family, called boxed: its group argument is `str` in some
// torch releases and `Any` in others, and a string fits both.
at::Tensor c10d_call(const char* name, std::vector<c10::IValue> stack, const std::string& group) {
  const auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  MIXPREC_CHECK(op.has_value(), "mixprec::fp8_linear: group_name '", group, "' is given but this torch has no ", name,
                " (built without torch.distributed)");
  try {
    op->callBoxed(stack);
  } catch (const c10::Error& e) {
    MIXPREC_CHECK(false, "mixprec::fp8_linear: group_name '", group, "': ", name,
                  " failed: ", e.what_without_backtrace());
  } catch (const std::exception& e) {  // c10d's own errors (an unknown group) are not c10::Errors
    MIXPREC_CHECK(false, "mixprec::fp8_linear: group_name '", group, "': ", name, " failed: ", e.what());
  }
  return stack.at(0).toTensor();
}

// `amax` becomes the max over the group's ranks, stream-ordered (no host sync). NaN turns into inf
// first: a MAX may drop a NaN (it compares), inf survives it and keeps every rank's output NaN.
at::Tensor all_reduce_max(const at::Tensor& amax, const std::string& group) {
  const at::Tensor sent = amax.masked_fill(amax.isnan(), std::numeric_limits<double>::infinity());
  const at::Tensor reduced = c10d_call("_c10d_functional::all_reduce", {sent, std::string("max"), group}, group);
  return c10d_call("_c10d_functional::wait_tensor", {reduced}, group);
}

// Current scaling's amaxes of xs into `rows` (consecutive amax rows), reduced over the group when
// there is one: the tensors of one call are known together, so one collective serves them all.
// Measured into a copy then: a failing collective leaves the state as it was.
void measure(std::initializer_list<at::Tensor> xs, const at::Tensor& rows, const Spec& s) {
  const at::Tensor m = s.group ? rows.clone() : rows;
  int64_t i = 0;
  for (const at::Tensor& x : xs) mixprec::fp8_amax_(x, m.narrow(0, i++, 1));
  if (s.group) rows.copy_(all_reduce_max(m, *s.group));
}

// x cast with its row's scale. Current scaling: the amax measured just before becomes the scale.
// Delayed: the scale comes from the history and the cast records x's amax in the same read.
Cast cast(const at::Tensor& x, const Row& r, at::ScalarType dtype, const Spec& s, bool transpose,
          const std::optional<at::Tensor>& saturation, int64_t role) {
  Cast c;
  mixprec::fp8_update_scale_(r.scale, r.history, r.amax, dtype, s.margin, s.delayed ? s.reduction : "most_recent");
  std::tie(c.q, c.q_t) =
      mixprec::fp8_quantize(x, r.scale, dtype, transpose, s.delayed ? std::optional<at::Tensor>(r.amax) : std::nullopt);
  if (saturation.has_value()) {
    // Clipped, not merely at the max: under current scaling the amax element lands exactly there.
    const double max =
        fp8_format_of(kOp, "dtype", dtype) == kernels::Fp8Format::kE4M3 ? kernels::kFp8E4M3Max : kernels::kFp8E5M2Max;
    const at::Tensor clipped = (x.to(at::kFloat).abs() * r.scale > max).sum().to(at::kDouble);
    const at::Tensor total = at::scalar_tensor(c10::Scalar(x.sym_numel()), clipped.options());
    saturation->select(0, role).add_(at::stack({total, clipped}));
  }
  // The GEMM's dequantization factor; NaN when x held inf/NaN (the cast saturated those, and the
  // output must still show them to a loss scaler). Current scaling's amax is in the history now.
  const at::Tensor seen = s.delayed ? r.amax : r.history.narrow(0, 0, 1);
  c.inv = at::where(seen.isfinite(), r.scale.reciprocal(), std::numeric_limits<double>::quiet_NaN());
  return c;
}

struct Forward {
  at::Tensor y;  // [tokens, out_features]
  Cast x, w;
};

// x2 [tokens, k] contiguous. The transposes are what the gradient GEMMs will read (x^T for the
// weight gradient, W^T for the input gradient): written in the cast's pass, only when needed.
Forward run_forward(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const at::Tensor& scale, const at::Tensor& amax, const at::Tensor& history, const Spec& s,
                    bool need_dgrad, bool need_wgrad, const std::optional<at::Tensor>& saturation) {
  const at::Tensor w = weight.contiguous();
  if (!s.delayed) measure({x2, w}, amax.narrow(0, kInput, 2), s);
  Forward f;
  f.x = cast(x2, row(scale, amax, history, kInput), s.forward_dtype, s, need_wgrad, saturation, kInput);
  f.w = cast(w, row(scale, amax, history, kWeight), s.forward_dtype, s, need_dgrad, saturation, kWeight);
  f.y = fp8_scaled_mm(f.x.q, f.w.q.t(), f.x.inv, f.w.inv, x2.scalar_type(), bias);
  return f;
}

at::Tensor flat_input(const at::Tensor& input, const at::Tensor& weight) {
  return input.reshape_symint({c10::SymInt(-1), weight.sym_size(1)}).contiguous();
}

at::Tensor unflatten(const at::Tensor& y2, c10::SymIntArrayRef leading_like, const c10::SymInt& last) {
  std::vector<c10::SymInt> out_shape(leading_like.begin(), leading_like.end());
  out_shape.back() = last;
  return y2.view_symint(out_shape);
}

// Every argument checked, before anything is written (a refused call changes nothing), and the
// recipe they spell.
Spec checked_spec(MIXPREC_FP8_LINEAR_PARAMS) {
  Spec s{forward_dtype,
         backward_dtype,
         delayed,
         margin,
         std::string(reduction),
         group_name ? std::optional<std::string>(std::string(*group_name)) : std::nullopt};
  check_args(input, weight, bias, scale, amax, amax_history, s, saturation);
  return s;
}

// y = x W^T + b; backward casts the output gradient to the backward dtype. What backward keeps is
// FP8 (x^T and W^T, already in the layout the gradient GEMMs read) plus two scalars: a quarter of
// the bf16 activations' memory. The grad row of the state is kept as views, not a pointer to an
// owner, so a module destroyed before backward leaves nothing dangling.
class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& scale, const at::Tensor& amax,
                            const at::Tensor& history, const Spec& s, bool need_dgrad, bool need_wgrad,
                            const std::optional<at::Tensor>& saturation) {
    Forward f = run_forward(flat_input(input, weight), weight, bias, scale, amax, history, s, need_dgrad, need_wgrad,
                            saturation);
    const Row g = row(scale, amax, history, kGradOutput);
    ctx->saved_data["row"] = c10::List<at::Tensor>({g.scale, g.amax, g.history});
    ctx->saved_data["saturation"] = saturation.has_value() ? c10::IValue(*saturation) : c10::IValue();
    ctx->saved_data["recipe"] = c10::List<int64_t>({static_cast<int64_t>(s.backward_dtype), s.delayed});
    ctx->saved_data["margin"] = s.margin;
    ctx->saved_data["reduction"] = s.reduction;
    ctx->saved_data["group"] = s.group ? c10::IValue(*s.group) : c10::IValue();
    ctx->saved_data["dtypes"] =
        c10::List<int64_t>({static_cast<int64_t>(input.scalar_type()), static_cast<int64_t>(weight.scalar_type())});
    const bool need_bgrad = bias.has_value() && bias->defined() && bias->requires_grad();
    ctx->saved_data["flags"] = c10::List<bool>({need_dgrad, need_wgrad, need_bgrad});
    ctx->save_for_backward({f.x.q_t, f.w.q_t, f.x.inv, f.w.inv});
    return unflatten(f.y, input.sym_sizes(), weight.sym_size(0));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(10);
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xq_t = saved[0], &wq_t = saved[1], &x_inv = saved[2], &w_inv = saved[3];
    const auto flags = ctx->saved_data["flags"].toBoolList();
    const auto dtypes = ctx->saved_data["dtypes"].toIntList();
    const bool need_dgrad = flags[0], need_wgrad = flags[1], need_bgrad = flags[2];
    const c10::SymInt n = grads[0].sym_size(-1);
    const at::Tensor dy2 = grads[0].reshape_symint({c10::SymInt(-1), n}).contiguous();
    if (need_dgrad || need_wgrad) {
      const auto r = ctx->saved_data["row"].toTensorList();
      const auto recipe = ctx->saved_data["recipe"].toIntList();
      const c10::IValue& group = ctx->saved_data["group"];
      const Spec s{c10::ScalarType(),
                   static_cast<at::ScalarType>(recipe[0]),
                   recipe[1] != 0,
                   ctx->saved_data["margin"].toDouble(),
                   ctx->saved_data["reduction"].toStringRef(),
                   group.isNone() ? std::nullopt : std::optional<std::string>(group.toStringRef())};
      const c10::IValue& sat = ctx->saved_data["saturation"];
      const std::optional<at::Tensor> saturation = sat.isNone() ? std::nullopt : std::optional(sat.toTensor());
      if (!s.delayed) measure({dy2}, r[1], s);
      const Cast g = cast(dy2, Row{r[0], r[1], r[2]}, s.backward_dtype, s, need_wgrad, saturation, kGradOutput);
      if (need_dgrad) {
        const at::Tensor dx2 = fp8_scaled_mm(g.q, wq_t.t(), g.inv, w_inv, static_cast<at::ScalarType>(dtypes[0]));
        out[0] = unflatten(dx2, grads[0].sym_sizes(), wq_t.sym_size(0));
      }
      if (need_wgrad) out[1] = fp8_scaled_mm(g.q_t, xq_t.t(), g.inv, x_inv, static_cast<at::ScalarType>(dtypes[1]));
    }
    // The unquantized gradient: a sum needs no FP8.
    if (need_bgrad) out[2] = dy2.to(at::kFloat).sum(0).to(static_cast<at::ScalarType>(dtypes[1]));
    return out;
  }
};

at::Tensor fp8_linear_no_autograd(MIXPREC_FP8_LINEAR_PARAMS) {
  const Spec s = checked_spec(MIXPREC_FP8_LINEAR_ARGS);
  const Forward f =
      run_forward(flat_input(input, weight), weight, bias, scale, amax, amax_history, s, false, false, saturation);
  return unflatten(f.y, input.sym_sizes(), weight.sym_size(0));
}

at::Tensor fp8_linear_autograd(MIXPREC_FP8_LINEAR_PARAMS) {
  const Spec s = checked_spec(MIXPREC_FP8_LINEAR_ARGS);
  // Only the transposes a gradient will read are written (apply runs forward with grad off).
  const bool grad = at::GradMode::is_enabled();
  return Fp8LinearFunction::apply(input, weight, bias, scale, amax, amax_history, s, grad && input.requires_grad(),
                                  grad && weight.requires_grad(), saturation);
}

}  // namespace

at::Tensor fp8_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                         at::ScalarType out_dtype, const std::optional<at::Tensor>& bias, std::optional<bool> emulate) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (!emulate.value_or(!a.is_cuda())) {
    // _scaled_mm adds a bias only in the output dtype, and not for fp32 outputs.
    const bool fuse_bias = has_bias && bias->scalar_type() == out_dtype && out_dtype != at::kFloat;
    at::Tensor y = at::_scaled_mm(a, b, scale_a.reshape({}), scale_b.reshape({}),
                                  fuse_bias ? bias : std::optional<at::Tensor>(), std::nullopt, out_dtype);
    if (has_bias && !fuse_bias) y = (y.to(at::kFloat) + bias->to(at::kFloat)).to(out_dtype);
    return y;
  }
  // FP8 values widen exactly to fp32; one fp32 product and one rounding, as the tensor cores.
  at::Tensor y = at::mm(a.to(at::kFloat), b.to(at::kFloat)).mul_(scale_a * scale_b);
  if (has_bias) y.add_(bias->to(at::kFloat));
  return y.to(out_dtype);
}

at::Tensor fp8_linear_meta(MIXPREC_FP8_LINEAR_PARAMS) {
  checked_spec(MIXPREC_FP8_LINEAR_ARGS);
  std::vector<c10::SymInt> out_shape(input.sym_sizes().begin(), input.sym_sizes().end());
  out_shape.back() = weight.sym_size(0);
  return at::empty_symint(out_shape, input.options());
}

TORCH_LIBRARY_IMPL(mixprec, CompositeExplicitAutograd, m) { m.impl("fp8_linear", &fp8_linear_no_autograd); }
TORCH_LIBRARY_IMPL(mixprec, Autograd, m) { m.impl("fp8_linear", &fp8_linear_autograd); }
TORCH_LIBRARY_IMPL(mixprec, CompositeImplicitAutograd, m) { m.impl("fp8_scaled_mm", &fp8_scaled_mm); }

}  // namespace mixprec::detail
