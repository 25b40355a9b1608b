// Every mixprec op's schema, in one place: the contract that the CPU, CUDA and Meta impls, the
// Python wrappers (python/mixprec/_ops.py) and the C++ header (include/mixprec/ops.h) all follow.
//
// Conventions. Lists of tensors are matched by index. Optional behaviour is an optional tensor
// or an empty list, never another op: an empty `out` or `master_params` list means "none".
// Device scalars (found_inf, inv_scale, grad_scale, lr_tensor, step_tensor) are one-element
// float32 tensors on the op's device; found_inf is 1.0 when a step must be skipped. With
// step_tensor given, an optimizer op increments it on the device unless found_inf is set, and
// uses it for bias correction; otherwise the host `step` (counting this step) is used.
#include <torch/library.h>

#include <string>

#ifndef MIXPREC_TORCH_VERSION
#define MIXPREC_TORCH_VERSION "unknown"
#endif

namespace mixprec::detail {
// The version of torch this library was compiled against; Python compares it on import.
const char* built_torch_version() { return MIXPREC_TORCH_VERSION; }
}  // namespace mixprec::detail

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
  m.def("layer_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor");

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
  // changes at all, grads included.
  // State lists are float32 (Adam moments may be bfloat16) and shaped like params.
  //
  // Adam/AdamW: adam_w_mode picks decoupled weight decay (else L2 added to the gradient);
  // amsgrad is on when max_exp_avg_sqs is non-empty.
  m.def(
      "adam_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, Tensor(f!)? step_tensor, *, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction, "
      "bool maximize=False, int step=0, Tensor? lr_tensor=None, Tensor? grad_scale=None, "
      "Tensor? found_inf=None) -> ()");
  // SGD with torch.optim.SGD's semantics (the first step, step == 1, sets the momentum buffer to
  // the gradient); momentum_buffers is empty iff momentum == 0. wd_after_momentum (Apex) adds
  // the decay after the momentum update instead of to the gradient.
  m.def(
      "sgd_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] momentum_buffers, Tensor(e!)[] master_params, "
      "Tensor(f!)? step_tensor, *, float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
      "bool wd_after_momentum=False, bool maximize=False, int step=0, Tensor? lr_tensor=None, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  // LAMB (You et al. 2019) with Apex's options: grads clipped by max_grad_norm against the
  // global gradient norm (global_grad_norm, the unscaled norm over all groups, computed here
  // from grads when None), per-tensor trust ratio ||w|| / ||update||, use_nvlamb applying it
  // also to tensors without weight decay; adam_w_mode picks decoupled decay.
  // Sharded tensors (FSDP2) need whole-tensor norms between the op's two passes, so the step
  // can be split in two calls with the same arguments: with local_norms (float32 [2, n]) the op
  // runs the first pass only (step count, moments) and writes ||w|| and ||u|| of each tensor as
  // given (a shard) into it; the caller reduces them across ranks and passes the result as
  // trust_norms, and that call runs the second pass only (the update).
  m.def(
      "lamb_(Tensor(a!)[] params, Tensor(h!)[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(e!)[] master_params, Tensor(f!)? step_tensor, *, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode, float max_grad_norm, "
      "bool use_nvlamb, int step=0, Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None, "
      "Tensor? global_grad_norm=None, Tensor(g!)? local_norms=None, Tensor? trust_norms=None) -> ()");
  // Adagrad with torch.optim.Adagrad's lr_decay; adagrad_w_mode (Apex) decays decoupled,
  // otherwise the L2 term is added to the gradient.
  m.def(
      "adagrad_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] state_sums, Tensor(e!)[] master_params, "
      "Tensor(f!)? step_tensor, *, float lr, float eps, float weight_decay, float lr_decay, bool adagrad_w_mode, "
      "bool maximize=False, int step=0, Tensor? lr_tensor=None, Tensor? grad_scale=None, "
      "Tensor? found_inf=None) -> ()");
  // NovoGrad (Ginsburg et al. 2019) with Apex's options: a per-tensor second moment
  // (exp_avg_sq_norms, float32 [len(params)]) from the norm of each gradient (norm_type 2 or
  // inf), grad_averaging, reg_inside_moment, init_zero. grad_norms (float32 [len(params)], the
  // norms of the grads as stored, still scaled) replaces the op's own norm pass: for sharded
  // tensors, whose whole-tensor norms the caller reduces across ranks.
  m.def(
      "novograd_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] exp_avgs, Tensor(c!) exp_avg_sq_norms, "
      "Tensor(e!)[] master_params, Tensor(f!)? step_tensor, *, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool grad_averaging, bool reg_inside_moment, float norm_type, "
      "bool init_zero, int step=0, Tensor? lr_tensor=None, Tensor? grad_scale=None, "
      "Tensor? found_inf=None, Tensor? grad_norms=None) -> ()");
}
