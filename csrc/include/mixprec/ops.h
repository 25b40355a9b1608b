// mixprec's ops for C++ (LibTorch) callers: typed calls through PyTorch's dispatcher, so C++
// reaches exactly the kernels that Python's torch.ops.mixprec does. Host-compilable, header-only.
// Semantics of each op are documented with its schema in csrc/ops/library.cpp and in
// python/mixprec/_ops.py; the library (mixprec::mixprec) must be linked for the ops to exist.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <mixprec/export.h>
#include <mixprec/optim_args.h>

namespace mixprec {
namespace detail {
// Defined in libmixprec. Referencing it keeps the library linked even under --as-needed: its
// static initializers are what register the ops with the dispatcher.
MIXPREC_API const char* built_torch_version();
inline const char* const kLinkedAgainstTorch = built_torch_version();
}  // namespace detail
// Sets found_inf to 1 if any grad holds inf/NaN; with inv_scale also multiplies the grads by it,
// in place or into `out`; per_tensor_found[i] = 1 for each grad i that held inf/NaN. An
// inv_scale of inf, NaN or 0 counts as inf/NaN in every (non-empty) grad.
inline void non_finite_check_and_unscale_(at::TensorList grads, const std::optional<at::Tensor>& found_inf,
                                          const std::optional<at::Tensor>& inv_scale = std::nullopt,
                                          at::TensorList out = {},
                                          const std::optional<at::Tensor>& per_tensor_found = std::nullopt) {
  using Sig = void(at::TensorList, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, at::TensorList,
                   const std::optional<at::Tensor>&);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::non_finite_check_and_unscale_", "").typed<Sig>();
  op.call(grads, found_inf, inv_scale, out, per_tensor_found);
}

// Multiplies every tensor in place by the device scalar `scale` (gradient clipping).
inline void scale_(at::TensorList tensors, const at::Tensor& scale) {
  non_finite_check_and_unscale_(tensors, std::nullopt, scale);
}

struct ScaleUpdateOptions {
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t hysteresis = 1;
  double min_scale = 0.0;
  double max_scale = 0.0;  // 0: no cap
};

// Dynamic loss-scale update on the device (see library.cpp for the exact rule): a backoff never
// goes below 2^-126 (kernels::kScaleFloor) even with min_scale 0, and a NaN scale stays NaN.
inline void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                          const ScaleUpdateOptions& options = {},
                          const std::optional<at::Tensor>& hysteresis_tracker = std::nullopt,
                          const std::optional<at::Tensor>& skipped_steps = std::nullopt) {
  using Sig =
      void(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
           const at::Tensor&, double, double, int64_t, int64_t, double, double);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::update_scale_", "").typed<Sig>();
  op.call(scale, growth_tracker, hysteresis_tracker, skipped_steps, found_inf, options.growth_factor,
          options.backoff_factor, options.growth_interval, options.hysteresis, options.min_scale, options.max_scale);
}

// (total, per_tensor): the 2- or inf-norm of all tensors together (0-dim float32) and of each
// (float32 [n], empty unless per_tensor).
inline std::tuple<at::Tensor, at::Tensor> multi_tensor_norm(at::TensorList tensors, double ord = 2.0,
                                                            bool per_tensor = false) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(at::TensorList, double, bool);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::multi_tensor_norm", "").typed<Sig>();
  return op.call(tensors, ord, per_tensor);
}

// ---- cross-entropy loss ------------------------------------------------------------------------
// (losses, lse), float32 [N], from logits [N, V] (fp32/fp16/bf16, contiguous) and int64 target [N],
// in fp32 without an fp32 copy of the logits; losses are 0 where target == ignore_index.
inline std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& target,
                                                                int64_t ignore_index = -100) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::cross_entropy_forward", "").typed<Sig>();
  return op.call(logits, target, ignore_index);
}

// The logits' gradient in their dtype: grad_losses[i] * (softmax(logits[i]) - onehot(target[i])).
inline at::Tensor cross_entropy_backward(const at::Tensor& grad_losses, const at::Tensor& logits,
                                         const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index = -100) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::cross_entropy_backward", "").typed<Sig>();
  return op.call(grad_losses, logits, target, lse, ignore_index);
}

// ---- a Linear layer's bias gradient ------------------------------------------------------------
// grad [rows, out_features] (fp32/fp16/bf16, contiguous) summed over its rows in fp32, in a fixed
// order, rounded once to grad's dtype: [out_features].
inline at::Tensor linear_bias_grad(const at::Tensor& grad) {
  using Sig = at::Tensor(const at::Tensor&);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::linear_bias_grad", "").typed<Sig>();
  return op.call(grad);
}

// A Linear's weight and bias gradients from its output gradient grad [rows, out_features] and its
// input [rows, in_features] (contiguous, one dtype): (grad.t() @ input, grad summed over rows).
// On CUDA in fp16/bf16 one cuBLASLt GEMM computes both, the bias sum in its epilogue.
inline std::tuple<at::Tensor, at::Tensor> linear_weight_bias_grad(const at::Tensor& grad, const at::Tensor& input) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::linear_weight_bias_grad", "").typed<Sig>();
  return op.call(grad, input);
}

// torch::nn::functional::linear, differentiable, whose backward takes the bias gradient from
// linear_bias_grad; the forward and the backward's GEMMs are ATen's own.
inline at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias = std::nullopt) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::linear", "").typed<Sig>();
  return op.call(input, weight, bias);
}

// ---- LayerNorm ----------------------------------------------------------------------------------
// input [rows, C] contiguous (fp32/fp16/bf16), weight and bias [C] of its dtype or none ->
// (out, mean [rows] fp32, rstd [rows] fp32).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& input,
                                                                         const std::optional<at::Tensor>& weight,
                                                                         const std::optional<at::Tensor>& bias,
                                                                         double eps = 1e-5) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                             const std::optional<at::Tensor>&, double);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::layer_norm_forward", "").typed<Sig>();
  return op.call(input, weight, bias, eps);
}

// (grad_input, grad_weight, grad_bias) from layer_norm_forward's mean and rstd; a gradient whose
// output_mask entry is false comes back undefined.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, std::array<bool, 3> output_mask) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, const std::optional<at::Tensor>&,
                                                             std::array<bool, 3>);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::layer_norm_backward", "").typed<Sig>();
  return op.call(grad_out, input, mean, rstd, weight, output_mask);
}

// torch::nn::functional::layer_norm, differentiable, on the two ops above.
inline at::Tensor layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                             const std::optional<at::Tensor>& weight = std::nullopt,
                             const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5) {
  using Sig = at::Tensor(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                         const std::optional<at::Tensor>&, double);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::layer_norm", "").typed<Sig>();
  return op.call(input, normalized_shape, weight, bias, eps);
}

// input [..., *normalized_shape] contiguous (fp32/fp16/bf16), weight shaped normalized_shape of
// its dtype or float32, or none -> (out, rstd fp32 shaped input's leading dimensions).
inline std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                           const std::optional<at::Tensor>& weight, double eps) {
  using Sig =
      std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&, double);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::rms_norm_forward", "").typed<Sig>();
  return op.call(input, normalized_shape, weight, eps);
}

// (grad_input, grad_weight) from rms_norm_forward's rstd; a gradient whose output_mask entry is
// false comes back undefined.
inline std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& input,
                                                            at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                            const std::optional<at::Tensor>& weight,
                                                            std::array<bool, 2> output_mask) {
  using Sig =
      std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const at::Tensor&,
                                         const std::optional<at::Tensor>&, std::array<bool, 2>);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::rms_norm_backward", "").typed<Sig>();
  return op.call(grad_out, input, normalized_shape, rstd, weight, output_mask);
}

// torch::nn::functional::rms_norm, differentiable, on the two ops above; eps = nullopt is the
// input dtype's epsilon (torch's default).
inline at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                           const std::optional<at::Tensor>& weight = std::nullopt,
                           std::optional<double> eps = std::nullopt) {
  using Sig = at::Tensor(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&, std::optional<double>);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::rms_norm", "").typed<Sig>();
  return op.call(input, normalized_shape, weight, eps);
}

// ---- fused optimizer steps --------------------------------------------------------------------
// Scalars shared by every optimizer op (see csrc/ops/library.cpp): lr and step from the host, or
// one-element float32 device tensors (then a step is CUDA-graph capturable); grads divided by
// grad_scale inside the kernel; found_inf set makes the whole step a no-op. step_tensor is
// incremented on the device unless the step is skipped; without it, `step` counts this step.
struct StepArgs {
  double lr = 1e-3;
  std::optional<at::Tensor> step_tensor;
  int64_t step = 0;
  std::optional<at::Tensor> lr_tensor;
  std::optional<at::Tensor> grad_scale;
  std::optional<at::Tensor> found_inf;
  // Calls the op's validate-only twin <op>_check instead: every check the step makes, nothing
  // written (Python: validate_only=True), so a caller can check all its groups before any steps.
  bool validate_only = false;
};

namespace detail {
// The family's hyper-parameters onto a dispatcher stack, in the order of its field list (and of
// its schema, which library.cpp builds from the same list).
#define MIXPREC_PUSH_ARG(type, name, default_value) stack.emplace_back(a.name);
#define MIXPREC_DEFINE_PUSH_ARGS(op, Struct, MACRO)                               \
  inline void push_args(std::vector<c10::IValue>& stack, const Struct##Args& a) { \
    MIXPREC_##MACRO##_ARGS(MIXPREC_PUSH_ARG)                                      \
  }
MIXPREC_OPTIM_FAMILIES(MIXPREC_DEFINE_PUSH_ARGS)
#undef MIXPREC_DEFINE_PUSH_ARGS
#undef MIXPREC_PUSH_ARG

inline c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// A family's step "mixprec::<family>_" and its validate-only twin "mixprec::<family>_check".
struct OptimOp {
  c10::OperatorHandle step, check;
  explicit OptimOp(const std::string& family)
      : step(find_op(("mixprec::" + family + "_").c_str())),
        check(find_op(("mixprec::" + family + "_check").c_str())) {}
};

// Calls optimizer op `op` (its step, or with s.validate_only its check twin) through the
// dispatcher, boxed, with its arguments in schema order: the op's tensors, step_tensor, lr, the
// hyper-parameters, the other step scalars, the op's extra tensors. One body for every family: a
// new hyper-parameter reaches C++ callers through the Args struct alone.
template <class Args>
void call_optim(const OptimOp& op, std::initializer_list<c10::IValue> tensors, const Args& a, const StepArgs& s,
                std::initializer_list<c10::IValue> extras = {}) {
  const c10::OperatorHandle& handle = s.validate_only ? op.check : op.step;
  std::vector<c10::IValue> stack(tensors);
  stack.reserve(handle.schema().arguments().size());
  stack.emplace_back(s.step_tensor);
  stack.emplace_back(s.lr);
  push_args(stack, a);
  stack.emplace_back(s.step);
  stack.emplace_back(s.lr_tensor);
  stack.emplace_back(s.grad_scale);
  stack.emplace_back(s.found_inf);
  stack.insert(stack.end(), extras.begin(), extras.end());
  handle.callBoxed(&stack);
}
}  // namespace detail

// amsgrad when max_exp_avg_sqs is non-empty; fp32 master weights when master_params is non-empty;
// 8-bit moments (exp_avgs int8, exp_avg_sqs uint8 codes) when the two scale lists are non-empty.
inline void adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList max_exp_avg_sqs, at::TensorList master_params, const AdamArgs& a, const StepArgs& s,
                  at::TensorList exp_avg_scales = {}, at::TensorList exp_avg_sq_scales = {}) {
  static const detail::OptimOp op("adam");
  detail::call_optim(
      op, {params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales, exp_avg_sq_scales}, a,
      s);
}

// momentum_buffers is empty iff momentum == 0.
inline void sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                 at::TensorList master_params, const SgdArgs& a, const StepArgs& s) {
  static const detail::OptimOp op("sgd");
  detail::call_optim(op, {params, grads, momentum_buffers, master_params}, a, s);
}

// global_grad_norm: the unscaled gradient norm over every group (computed from grads when absent).
// local_norms / trust_norms (float32 [2, n]): the two halves of a step split for sharded tensors,
// whose per-tensor norms the caller reduces across ranks in between (see the op's schema).
inline void lamb_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList master_params, const LambArgs& a, const StepArgs& s,
                  const std::optional<at::Tensor>& global_grad_norm = std::nullopt,
                  const std::optional<at::Tensor>& local_norms = std::nullopt,
                  const std::optional<at::Tensor>& trust_norms = std::nullopt) {
  static const detail::OptimOp op("lamb");
  detail::call_optim(op, {params, grads, exp_avgs, exp_avg_sqs, master_params}, a, s,
                     {global_grad_norm, local_norms, trust_norms});
}

inline void adagrad_(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                     at::TensorList master_params, const AdagradArgs& a, const StepArgs& s) {
  static const detail::OptimOp op("adagrad");
  detail::call_optim(op, {params, grads, state_sums, master_params}, a, s);
}

// exp_avg_sq_norms: float32 [len(params)], the per-tensor second moments. grad_norms (float32
// [len(params)], norms of the grads as stored) replaces the op's own norm pass, for sharded tensors.
inline void novograd_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      const at::Tensor& exp_avg_sq_norms, at::TensorList master_params, const NovoGradArgs& a,
                      const StepArgs& s, const std::optional<at::Tensor>& grad_norms = std::nullopt) {
  static const detail::OptimOp op("novograd");
  detail::call_optim(op, {params, grads, exp_avgs, exp_avg_sq_norms, master_params}, a, s, {grad_norms});
}

// ---- FP8 casts and scales (kernels/fp8.*) --------------------------------------------------------
// x (contiguous fp32/fp16/bf16) * scale (float32 scalar), saturated to dtype's +-max
// (kFloat8_e4m3fn 448, kFloat8_e5m2 57344; NaN stays NaN) and rounded to nearest even: (out,
// out_t), out_t = out.t() contiguous when transpose (x 2-D), else undefined. amax, when given,
// becomes max(amax, max |x|) on the device in the same read.
inline std::tuple<at::Tensor, at::Tensor> fp8_quantize(const at::Tensor& x, const at::Tensor& scale,
                                                       c10::ScalarType dtype, bool transpose = false,
                                                       const std::optional<at::Tensor>& amax = std::nullopt) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, c10::ScalarType, bool,
                                                 const std::optional<at::Tensor>&);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::fp8_quantize", "").typed<Sig>();
  auto out = op.call(x, scale, dtype, transpose, amax);
  if (!transpose) std::get<1>(out) = at::Tensor();
  return out;
}

// amax = max(amax, max |x|) on the device: current scaling's measure before the scale exists.
inline void fp8_amax_(const at::Tensor& x, const at::Tensor& amax) {
  using Sig = void(const at::Tensor&, const at::Tensor&);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::fp8_amax_", "").typed<Sig>();
  op.call(x, amax);
}

// amax is pushed into amax_history (newest first) and reset to 0; the history is reduced ("max"
// or "most_recent") and scale = fp8_max(dtype) / (reduced * 2^margin), unless the reduced amax is
// 0, inf or NaN (the scale is kept). On the device, no host sync.
inline void fp8_update_scale_(const at::Tensor& scale, const at::Tensor& amax_history, const at::Tensor& amax,
                              c10::ScalarType dtype, double margin = 0.0, c10::string_view reduction = "max") {
  using Sig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::ScalarType, double, c10::string_view);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::fp8_update_scale_", "").typed<Sig>();
  op.call(scale, amax_history, amax, dtype, margin, reduction);
}

// A Linear's three GEMMs on FP8 operands, differentiable, with the scaling state (scale, amax
// [3], amax_history [3, L], float32) updated on the device: y = x W^T + b (fp8::linear and
// python's Fp8Linear call it; the schema in csrc/ops/library.cpp has the details).
inline at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const at::Tensor& scale, const at::Tensor& amax, const at::Tensor& amax_history,
                             c10::ScalarType forward_dtype, c10::ScalarType backward_dtype, bool delayed = false,
                             double margin = 0.0, c10::string_view reduction = "max",
                             std::optional<c10::string_view> group_name = std::nullopt,
                             const std::optional<at::Tensor>& saturation = std::nullopt) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, c10::ScalarType, c10::ScalarType, bool, double,
                         c10::string_view, std::optional<c10::string_view>, const std::optional<at::Tensor>&);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::fp8_linear", "").typed<Sig>();
  return op.call(input, weight, bias, scale, amax, amax_history, forward_dtype, backward_dtype, delayed, margin,
                 reduction, group_name, saturation);
}

// (a * scale_a) @ (b * scale_b) (+ bias), FP8 a row-major and b column-major, fp32 accumulation,
// one rounding to out_dtype: at::_scaled_mm, or (emulate; default off CUDA) exact fp32 widening.
inline at::Tensor fp8_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                const at::Tensor& scale_b, c10::ScalarType out_dtype,
                                const std::optional<at::Tensor>& bias = std::nullopt,
                                std::optional<bool> emulate = std::nullopt) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::ScalarType,
                         const std::optional<at::Tensor>&, std::optional<bool>);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::fp8_scaled_mm", "").typed<Sig>();
  return op.call(a, b, scale_a, scale_b, out_dtype, bias, emulate);
}

// Why (weight, input) would run plain linear instead of fp8_linear ("" if FP8 takes them); with
// no input, why a Linear of this weight cannot become an FP8 Linear. The rule fp8::linear,
// fp8::ineligibility and python's Fp8Linear all follow (the schema in csrc/ops/library.cpp).
inline std::string fp8_linear_ineligibility(const at::Tensor& weight,
                                            const std::optional<at::Tensor>& input = std::nullopt) {
  using Sig = std::string(const at::Tensor&, const std::optional<at::Tensor>&);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::fp8_linear_ineligibility", "").typed<Sig>();
  return op.call(weight, input);
}

// Raises unless every param is bfloat16, in the words of the caller (owner), its option and its
// way of naming param i (where, "{}" for i): the rule of remainder masters, both fronts'.
inline void master_remainder_check(at::TensorList params, c10::string_view owner, c10::string_view option,
                                   c10::string_view where, bool loaded = false) {
  using Sig = void(at::TensorList, c10::string_view, c10::string_view, c10::string_view, bool);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::master_remainder_check", "").typed<Sig>();
  op.call(params, owner, option, where, loaded);
}

}  // namespace mixprec
