// Every mixprec op's schema, in one place: the contract that the CPU, CUDA and Meta impls, the
// Python wrappers (python/mixprec/_ops.py) and the C++ header (include/mixprec/ops.h) all follow.
// The fused optimizers' schemas are built here from their declarations in mixprec/optim_args.h
// (MIXPREC_DEF_OPTIM), which their impls (ops/optim.h), typed C++ calls and Python calls read too.
//
// Conventions. Lists of tensors are matched by index. Optional behaviour is an optional tensor
// or an empty list, never another op: an empty `out` or `master_params` list means "none".
// Device scalars (found_inf, inv_scale, grad_scale, lr_tensor, step_tensor) are one-element
// float32 tensors on the op's device; found_inf is 1.0 when a step must be skipped. With
// step_tensor given, an optimizer op increments it on the device unless found_inf is set, and
// uses it for bias correction; otherwise the host `step` (counting this step) is used.
#include <torch/library.h>

#include <string>

#include <mixprec/ops.h>  // declares built_torch_version MIXPREC_API: its definition below is exported
#include <mixprec/optim_args.h>

#include "ops/format.h"
#include "ops/front_rules.h"

#ifndef MIXPREC_TORCH_VERSION
#define MIXPREC_TORCH_VERSION "unknown"
#endif

namespace mixprec::detail {
// The version of torch this library was compiled against; Python compares it on import.
const char* built_torch_version() { return MIXPREC_TORCH_VERSION; }

namespace {

// Pieces of an optimizer op's schema (see the fused optimizers below). `check`: the validate-only
// twin, whose arguments carry no alias annotations.
void add(std::string& s, const std::string& arg) { s += (s.empty() ? "" : ", ") + arg; }

void add_tensor(std::string& s, bool check, bool list, const char* name, const char* alias) {
  add(s, std::string("Tensor") + (check ? "" : std::string("(") + alias + ")") + (list ? "[] " : " ") + name);
}

void add_extra(std::string& s, bool check, const char* name, const char* alias) {
  const bool annotate = !check && *alias != '\0';
  add(s, std::string("Tensor") + (annotate ? std::string("(") + alias + ")" : "") + "? " + name + "=None");
}

// A hyper-parameter with its declared default, as the schema parser reads it.
void add_arg(std::string& s, const char* name, double v) {
  std::string text = num(v);                                       // shortest round trip; "1e-08", "0.9", "0" ...
  if (text.find_first_of(".e") == std::string::npos) text += ".";  // a float literal, not an int
  add(s, std::string("float ") + name + "=" + text);
}
void add_arg(std::string& s, const char* name, bool v) {
  add(s, std::string("bool ") + name + (v ? "=True" : "=False"));
}
void add_arg(std::string& s, const char* name, int64_t v) {
  add(s, std::string("int ") + name + "=" + std::to_string(v));
}

}  // namespace
}  // namespace mixprec::detail

#define MIXPREC_SCHEMA_IS_LIST_LIST true
#define MIXPREC_SCHEMA_IS_LIST_TENSOR false
#define MIXPREC_SCHEMA_TENSOR(kind, name, alias) \
  mixprec::detail::add_tensor(s, check, MIXPREC_SCHEMA_IS_LIST_##kind, #name, alias);
#define MIXPREC_SCHEMA_ARG(type, name, default_value) mixprec::detail::add_arg(s, #name, type(default_value));
#define MIXPREC_SCHEMA_EXTRA(name, alias) mixprec::detail::add_extra(s, check, #name, alias);
// Defines family `op`'s schema (`check`: its validate-only twin's) from its declaration.
#define MIXPREC_DEF_OPTIM(op, Struct, MACRO)                                                     \
  {                                                                                              \
    std::string s;                                                                               \
    MIXPREC_##MACRO##_TENSORS(MIXPREC_SCHEMA_TENSOR) s +=                                        \
        check ? ", Tensor? step_tensor, *, float lr" : ", Tensor(f!)? step_tensor, *, float lr"; \
    MIXPREC_##MACRO##_ARGS(MIXPREC_SCHEMA_ARG) s +=                                              \
        ", int step=0, Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None"; \
    MIXPREC_##MACRO##_EXTRAS(MIXPREC_SCHEMA_EXTRA)                                               \
        m.def((std::string(#op) + (check ? "_check(" : "_(") + s + ") -> ()").c_str());          \
  }

TORCH_LIBRARY(mixprec, m) {
  // The torch version the library was compiled against, checked by `import mixprec`.
  m.def("_built_torch_version() -> str", [] { return std::string(mixprec::detail::built_torch_version()); });

  // ---- loss scaling (kernels/loss_scale.*) ------------------------------------------------
  // Sets found_inf to 1 if any element of grads is inf or NaN. With inv_scale, also multiplies
  // every element by it: into `out` (same shapes, any float dtype) when given, else in place.
  // Without inv_scale it only reads. per_tensor_found[i] is set to 1 for each grads[i] holding
  // inf/NaN, in the same pass. found_inf may be None for pure scaling (gradient clipping).
  // An inv_scale that is inf, NaN or zero (scale 0, NaN or inf) also sets both flags: torch
  // does not test it, but its products must never reach a step.
  m.def(
      "non_finite_check_and_unscale_(Tensor(a!)[] grads, Tensor(b!)? found_inf, Tensor? inv_scale, "
      "Tensor(c!)[] out, Tensor(d!)? per_tensor_found=None) -> ()");
  // Dynamic loss-scale update on the device: on overflow the scale backs off after `hysteresis`
  // overflows (tracked by hysteresis_tracker) but not below min_scale nor below 2^-126 (the
  // smallest normal float32, where torch reaches 0); a NaN scale stays NaN. After growth_interval
  // clean steps it grows, capped at max_scale (0: no cap). skipped_steps (int64) counts
  // overflows. With hysteresis 1 and no bounds it equals torch._amp_update_scale_ (above 2^-126).
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!)? hysteresis_tracker, "
      "Tensor(d!)? skipped_steps, Tensor found_inf, float growth_factor, float backoff_factor, "
      "int growth_interval, int hysteresis=1, float min_scale=0., float max_scale=0.) -> ()");

  // ---- FP8 casts and scales (kernels/fp8.*) ---------------------------------------------------
  // x (contiguous fp32/fp16/bf16) -> (out, out_t): out = x * scale saturated to +-max of `dtype`
  // (float8_e4m3fn 448, float8_e5m2 57344; inf saturates, NaN stays NaN) and rounded to nearest
  // even, shaped like x; with transpose (x 2-D) out_t = out.t() contiguous, else out_t is [0].
  // One read of x; amax (float32 scalar), when given, becomes max(amax, max |x|) (NaN if x has NaN).
  m.def(
      "fp8_quantize(Tensor x, Tensor scale, ScalarType dtype, bool transpose=False, Tensor(a!)? amax=None) -> "
      "(Tensor, Tensor)");
  // amax = max(amax, max |x|) alone: current scaling needs it before the scale exists.
  m.def("fp8_amax_(Tensor x, Tensor(a!) amax) -> ()");
  // On the device: amax is pushed into amax_history (newest first, the oldest drops) and reset to
  // 0; the history is reduced ('max' over it, or 'most_recent'), and scale = fp8_max(dtype) /
  // (reduced * 2^margin), unless the reduced amax is 0, inf or NaN (the scale is kept).
  m.def(
      "fp8_update_scale_(Tensor(a!) scale, Tensor(b!) amax_history, Tensor(c!) amax, ScalarType dtype, "
      "float margin=0., str reduction=\"max\") -> ()");
  // A Linear's three GEMMs on FP8 operands (ops/fp8_linear.cpp), differentiable: y = x W^T + b with
  // x and W cast to forward_dtype, and in backward the output gradient to backward_dtype; fp32
  // accumulation, outputs in input's dtype (dW in weight's). scale, amax [3] and amax_history
  // [3, L] (float32; rows input, weight, grad_output) are the scaling state, updated on the device
  // with no host sync: current scaling (delayed=False) measures each tensor's amax just before its
  // cast, delayed scaling takes the scale from the history (reduced by `reduction`, the scales
  // divided by 2^margin) and records the amax during the cast. With group_name, current scaling's
  // amaxes are all-reduced with MAX over that process group (one collective per call and
  // direction). saturation [3, 2] float64, when given, accumulates (elements, clipped elements)
  // per row. in/out_features and the token count must be multiples of 16. The bias gradient is
  // the unquantized gradient's sum.
  m.def(
      "fp8_linear(Tensor input, Tensor weight, Tensor? bias, Tensor(a!) scale, Tensor(b!) amax, "
      "Tensor(c!) amax_history, ScalarType forward_dtype, ScalarType backward_dtype, bool delayed=False, "
      "float margin=0., str reduction=\"max\", str? group_name=None, Tensor(d!)? saturation=None) -> Tensor");
  // (a * scale_a) @ (b * scale_b) (+ bias) for FP8 a (row-major) and b (column-major), fp32
  // accumulation, rounded once to out_dtype: torch._scaled_mm, or with emulate (default: off
  // CUDA) the FP8 values widened exactly to fp32 and one fp32 matmul, the same numerics.
  m.def(
      "fp8_scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, Tensor? bias=None, "
      "bool? emulate=None) -> Tensor");
  // Why (weight, input) would not run in FP8 ("" if it would), the rule both fronts' Linears
  // follow before calling fp8_linear, which refuses such shapes (ops/front_rules.h). Without
  // input, whether a module with this weight can become an FP8 Linear at all.
  m.def("fp8_linear_ineligibility(Tensor weight, Tensor? input=None) -> str",
        [](const at::Tensor& weight, const std::optional<at::Tensor>& input) {
          return mixprec::detail::fp8_linear_ineligibility(weight, input.has_value() ? &*input : nullptr);
        });

  // ---- the fused optimizers' front rules (ops/front_rules.h) -----------------------------------
  // Raises unless every param is bfloat16: a group keeping remainder masters (loaded=False), or
  // params whose checkpoint entries hold remainders (loaded=True). owner and option name the
  // caller and its option; where names param i with "{}" for i. Reads only dtypes.
  m.def(
      "master_remainder_check(Tensor[] params, str owner, str option, str where, bool loaded=False) -> ()",
      [](at::TensorList params, c10::string_view owner, c10::string_view option, c10::string_view where, bool loaded) {
        mixprec::detail::check_master_remainder(params, std::string(owner), std::string(option), std::string(where),
                                                loaded);
      });

  // The two forms of a master (ops/front_rules.h): (bf16 weight, int16 remainder) of an fp32
  // master, and the fp32 master they hold; bit for bit the kernels' split and rebuild.
  m.def("master_split(Tensor master) -> (Tensor, Tensor)", &mixprec::detail::master_split);
  m.def("master_rebuild(Tensor weight, Tensor remainder) -> Tensor", &mixprec::detail::master_rebuild);

  // ---- norms (kernels/norm.*) ---------------------------------------------------------------
  // Returns (total, per_tensor): the norm (ord 2 or inf) of all tensors together as a 0-dim
  // float32 tensor, and each tensor's norm as float32 [len(tensors)] (empty unless per_tensor).
  m.def("multi_tensor_norm(Tensor[] tensors, float ord=2., bool per_tensor=False) -> (Tensor, Tensor)");

  // ---- cross-entropy loss (kernels/cross_entropy.*) -------------------------------------------
  // logits [N, V] contiguous fp32/fp16/bf16, target [N] int64. Returns (losses, lse), float32
  // [N]: lse the log-sum-exp of each row, losses = lse - logits[i, target[i]] (0 where target ==
  // ignore_index). Math in fp32, one read of the logits. Targets outside [0, V) other than
  // ignore_index: an error on the CPU; on CUDA (no host sync) the row's loss is NaN and its
  // gradient row all NaN.
  m.def("cross_entropy_forward(Tensor logits, Tensor target, int ignore_index=-100) -> (Tensor, Tensor)");
  // grad_logits (logits' dtype and shape) = grad_losses[i] * (softmax(logits[i]) - onehot(target[i])),
  // from the forward's lse, computed in fp32 and rounded once; ignored rows are all zero.
  m.def(
      "cross_entropy_backward(Tensor grad_losses, Tensor logits, Tensor target, Tensor lse, "
      "int ignore_index=-100) -> Tensor");

  // ---- a Linear's bias gradient (kernels/bias_grad.*) -----------------------------------------
  // grad [rows, out_features] contiguous fp32/fp16/bf16 -> [out_features] in grad's dtype: the
  // rows summed in fp32, in a fixed order (the same result on every run), rounded once.
  m.def("linear_bias_grad(Tensor grad) -> Tensor");
  // torch.nn.functional.linear, whose backward takes the bias gradient from linear_bias_grad
  // (float64 from torch's sum); the forward and the backward's two GEMMs are ATen's own.
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // The weight and bias gradients of a Linear together: grad [rows, out_features] and input
  // [rows, in_features], contiguous, one dtype -> (grad.t() @ input, grad summed over its rows).
  // On CUDA in fp16/bf16 one cuBLASLt GEMM computes both (the bias sum in its epilogue, from the
  // gradient tiles the GEMM reads anyway); elsewhere torch's mm and linear_bias_grad.
  m.def("linear_weight_bias_grad(Tensor grad, Tensor input) -> (Tensor, Tensor)");

  // ---- LayerNorm over the last dimension (kernels/layer_norm.*) ---------------------------------
  // input [rows, C] contiguous fp32/fp16/bf16, weight and bias [C] of its dtype or None ->
  // (out like input, mean [rows] fp32, rstd [rows] fp32), rstd = 1 / sqrt(biased var + eps).
  m.def("layer_norm_forward(Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  // From the forward's mean and rstd: (grad_input, grad_weight, grad_bias), each computed only
  // where output_mask says (undefined otherwise); the parameter gradients are deterministic fp32 sums.
  m.def(
      "layer_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // torch.nn.functional.layer_norm on those two ops, differentiable; float64, and on CUDA a
  // normalized size past 12288, use torch's LayerNorm.
  m.def(
      "layer_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> "
      "Tensor");

  // ---- RMSNorm over the last dimensions (kernels/rms_norm.*) -----------------------------------
  // input [..., *normalized_shape] contiguous fp32/fp16/bf16, weight shaped normalized_shape of its
  // dtype or float32, or None -> (out like input, rstd fp32 shaped input's leading dimensions),
  // rstd = 1 / sqrt(mean(x^2) + eps).
  m.def("rms_norm_forward(Tensor input, int[] normalized_shape, Tensor? weight, float eps) -> (Tensor, Tensor)");
  // From the forward's rstd: (grad_input, grad_weight in the weight's dtype), each computed only
  // where output_mask says (undefined otherwise); the weight gradient is a deterministic fp32 sum.
  m.def(
      "rms_norm_backward(Tensor grad_out, Tensor input, int[] normalized_shape, Tensor rstd, Tensor? weight, "
      "bool[2] output_mask) -> (Tensor, Tensor)");
  // torch.nn.functional.rms_norm on those two ops, differentiable (eps None: the input dtype's
  // epsilon); float64, and on CUDA a normalized size past 24576, use torch's rms_norm.
  m.def("rms_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor");

  // ---- fused optimizers (kernels/<family>.*) -------------------------------------------------
  // Shared by every family: params (any float dtype) are updated in place; with master_params
  // (fp32, one per param) the master is the weight and params receive its rounding, in the same
  // pass. grads are divided by grad_scale when given, and then hold that unscaled gradient
  // (torch's fused-optimizer contract; not written without grad_scale). found_inf set: nothing
  // changes at all, grads included. An empty params list (with every other list empty) is a step
  // over nothing: the hyper-parameters are checked and nothing is touched, step_tensor included.
  // State lists are float32 (Adam moments may be bfloat16) and shaped like params.
  //
  // Each schema is built from the family's declaration in mixprec/optim_args.h (tensors, the
  // MIXPREC_<FAMILY>_ARGS field list with its defaults, extra tensors), around the shared step
  // scalars: "<op>_(<tensors>, Tensor(f!)? step_tensor, *, float lr, <hyper-parameters>,
  // int step=0, Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None, <extras>)
  // -> ()". Each op has a validate-only twin "<op>_check" with the same arguments, none of them
  // annotated as written: it runs every check of the step (ranges, devices, dtypes, shapes,
  // layouts, aliasing) and writes nothing, so a caller can validate all its groups before any steps.
  //
  // adam_ (Adam/AdamW): adam_w_mode picks decoupled weight decay (else L2 added to the gradient);
  // amsgrad is on when max_exp_avg_sqs is non-empty.
  // sgd_: torch.optim.SGD's semantics (the first step, step == 1, sets the momentum buffer to the
  // gradient); momentum_buffers is empty iff momentum == 0. wd_after_momentum (Apex) adds the
  // decay after the momentum update instead of to the gradient.
  // lamb_ (You et al. 2019) with Apex's options: grads clipped by max_grad_norm against the
  // global gradient norm (global_grad_norm, the unscaled norm over all groups, computed here
  // from grads when None), per-tensor trust ratio ||w|| / ||update||, use_nvlamb applying it
  // also to tensors without weight decay; adam_w_mode picks decoupled decay.
  // Sharded tensors (FSDP2) need whole-tensor norms between the op's two passes, so the step
  // can be split in two calls with the same arguments: with local_norms (float32 [2, n]) the op
  // runs the first pass only (step count, moments) and writes ||w|| and ||u|| of each tensor as
  // given (a shard) into it; the caller reduces them across ranks and passes the result as
  // trust_norms, and that call runs the second pass only (the update).
  // adagrad_: torch.optim.Adagrad's lr_decay; adagrad_w_mode (Apex) decays decoupled, otherwise
  // the L2 term is added to the gradient.
  // novograd_ (Ginsburg et al. 2019) with Apex's options: a per-tensor second moment
  // (exp_avg_sq_norms, float32 [len(params)]) from the norm of each gradient (norm_type 2 or
  // inf), grad_averaging, reg_inside_moment, init_zero. grad_norms (float32 [len(params)], the
  // norms of the grads as stored, still scaled) replaces the op's own norm pass: for sharded
  // tensors, whose whole-tensor norms the caller reduces across ranks.
  for (const bool check : {false, true}) {
    MIXPREC_OPTIM_FAMILIES(MIXPREC_DEF_OPTIM)
  }
}
