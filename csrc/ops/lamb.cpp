// Validation, scratch and pass sequencing for the fused LAMB op (see lamb.h and kernels/lamb.h):
// [global gradient norm] -> step increment -> moments pass -> per-tensor norms -> apply pass,
// all on the device's stream with no host synchronization; or, split for sharded tensors, the
// passes up to the per-tensor norms in one call and the apply pass in another.
#include "ops/lamb.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "ops/optim_common.h"

namespace mixprec::detail {
namespace {

constexpr const char* kOp = "lamb_";

// local_norms / trust_norms: float32 [2, n], row 0 ||w|| and row 1 ||u|| per tensor.
void check_norms_shape(const char* arg, const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.defined(), arg_name(kOp, arg), " is undefined");
  TORCH_CHECK_VALUE(t.dim() == 2 && t.sym_size(0) == 2 && t.sym_size(1) == n, arg_name(kOp, arg),
                    " must have shape [2, ", num(n), "] (||w|| and ||u|| per tensor of params), got ",
                    shape(t.sym_sizes()));
}

void check_norms_storage(const char* arg, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.device() == device, arg_name(kOp, arg), " is on ", t.device(), " but the op runs on ", device);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, arg_name(kOp, arg), " has dtype ", t.scalar_type(),
                   "; expected float32");
  TORCH_CHECK(t.is_contiguous(), arg_name(kOp, arg), " is not contiguous");
}

}  // namespace

void lamb_check_shapes(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList master_params,
                       const std::optional<at::Tensor>& local_norms, const std::optional<at::Tensor>& trust_norms) {
  const int64_t n = static_cast<int64_t>(params.size());
  for (const NamedList& l : {NamedList{"grads", grads}, NamedList{"exp_avgs", exp_avgs}, NamedList{"exp_avg_sqs", exp_avg_sqs}})
    TORCH_CHECK_VALUE(static_cast<int64_t>(l.tensors.size()) == n, arg_name(kOp, l.name), " has ",
                      num(l.tensors.size()), " tensors but params has ", num(n));
  TORCH_CHECK_VALUE(master_params.empty() || static_cast<int64_t>(master_params.size()) == n,
                    arg_name(kOp, "master_params"), " has ", num(master_params.size()), " tensors but params has ",
                    num(n));
  TORCH_CHECK_VALUE(!(local_norms && trust_norms), arg_name(kOp, "local_norms"),
                    " and trust_norms are the two halves of a split step: pass one of them, not both");
  if (local_norms) check_norms_shape("local_norms", *local_norms, n);
  if (trust_norms) check_norms_shape("trust_norms", *trust_norms, n);
}

void lamb_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList master_params, const std::optional<at::Tensor>& step_tensor, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool bias_correction, bool grad_averaging,
               bool adam_w_mode, double max_grad_norm, bool use_nvlamb, int64_t step,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& global_grad_norm,
               const std::optional<at::Tensor>& local_norms, const std::optional<at::Tensor>& trust_norms,
               LambRunners run) {
  check_range(kOp, "beta1", beta1, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "beta2", beta2, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "eps", eps, 0.0, INFINITY, true);
  check_range(kOp, "weight_decay", weight_decay, 0.0, INFINITY, true);
  // 0 (and inf) turn clipping off; Apex would divide every gradient by norm / 0 = inf.
  check_range(kOp, "max_grad_norm", max_grad_norm, 0.0, INFINITY);
  lamb_check_shapes(params, grads, exp_avgs, exp_avg_sqs, master_params, local_norms, trust_norms);
  const bool trust_ratio = weight_decay != 0.0 || use_nvlamb;
  TORCH_CHECK_VALUE(trust_ratio || !(local_norms || trust_norms), arg_name(kOp, local_norms ? "local_norms" : "trust_norms"),
                    ": a split step is for the trust ratio's norms, and this one takes none (weight_decay 0, "
                    "use_nvlamb false): it is one element-wise pass, call lamb_ once without them");
  if (params.empty()) return;
  const at::Device device = op_device(kOp, {"params", params}, std::nullopt);
  const kernels::StepScalars scalars =
      step_scalars(kOp, device, step_tensor, step, lr, lr_tensor, grad_scale, found_inf, bias_correction);
  if (global_grad_norm) check_scalar_tensor(kOp, "global_grad_norm", *global_grad_norm, device);
  if (local_norms) check_norms_storage("local_norms", *local_norms, device);
  if (trust_norms) check_norms_storage("trust_norms", *trust_norms, device);

  const NamedList param_list{"params", params}, avg_list{"exp_avgs", exp_avgs}, sq_list{"exp_avg_sqs", exp_avg_sqs};
  check_state_dtypes(kOp, avg_list, /*allow_bf16=*/false);
  check_state_dtypes(kOp, sq_list, false);
  const bool has_master = present(master_params);
  const NamedList master_list = master_list_or(master_params, param_list);
  if (has_master) check_state_dtypes(kOp, master_list, false);
  // An absent master list is stood in for by params: the kernels never touch it.
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(grads), avg_list, sq_list, master_list}, device, kInPlaceUpdate);
  // Everything is validated: from here on the op only runs.

  const c10::DeviceGuard guard(device);
  // The apply pass recomputes u from the moments alone: the gradient and its clipping are done.
  const bool clip = max_grad_norm > 0.0 && std::isfinite(max_grad_norm) && !trust_norms;
  at::Tensor own_norm;  // kept alive until every pass is queued (stream-ordered on CUDA)
  const float* norm_ptr = nullptr;
  if (clip && global_grad_norm) {
    norm_ptr = global_grad_norm->data_ptr<float>();
  } else if (clip) {
    // The norm of the grads as given (still scaled): the kernels divide it by grad_scale.
    own_norm = std::get<0>(multi_tensor_norm_impl(grads, 2.0, /*per_tensor=*/false, run.norm));
    norm_ptr = own_norm.data_ptr<float>();
  }

  const int64_t chunks = packed.total_chunks, n = packed.num_tensors;
  // One scratch buffer: partials of ||w||^2 and ||u||^2 per chunk, then ||w|| and ||u|| per
  // tensor, and the finalizer's unused total. The apply pass alone needs none of it.
  at::Tensor scratch;
  float* base = nullptr;
  if (trust_ratio && chunks > 0 && !trust_norms) {
    scratch = at::empty({2 * chunks + 2 * n + 1}, at::TensorOptions().dtype(at::kFloat).device(device));
    base = scratch.data_ptr<float>();
  }

  kernels::LambParams p;
  p.scalars = scalars;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.eps = static_cast<float>(eps);
  p.weight_decay = static_cast<float>(weight_decay);
  p.bias_correction = bias_correction;
  p.grad_averaging = grad_averaging;
  p.adam_w_mode = adam_w_mode;
  p.has_master = has_master;
  p.global_grad_norm = norm_ptr;
  p.global_grad_norm_scaled = own_norm.defined();
  p.max_grad_norm = static_cast<float>(max_grad_norm);
  p.trust_ratio = trust_ratio;
  if (base != nullptr) {
    p.param_partials = base;
    p.update_partials = base + chunks;
    p.param_norms = base + 2 * chunks;
    p.update_norms = base + 2 * chunks + n;
  }

  if (trust_norms) {
    // Second half of a split step: the moments and the step count are already updated.
    p.param_norms = trust_norms->data_ptr<float>();
    p.update_norms = p.param_norms + n;
  } else {
    if (step_tensor) run.increment_step(step_tensor_ptr(step_tensor), scalars.found_inf);
    for (const kernels::TensorGroup& g : packed.groups) {
      p.group = &g;
      run.moments(p);
    }
    if (local_norms) local_norms->zero_();  // empty tensors get no norm from the finalize
    if (!trust_ratio || chunks == 0) return;
    // Per-tensor norms from the partials (the norm machinery's finalize, once per quantity),
    // into the scratch, or for the first half of a split step into local_norms.
    float* norms = local_norms ? local_norms->data_ptr<float>() : base + 2 * chunks;
    for (int k = 0; k < 2; ++k) {
      kernels::NormFinalizeParams f;
      f.all = &packed.all;
      f.type = kernels::NormType::kL2;
      f.partials = base + k * chunks;
      f.total_chunks = chunks;
      f.total = base + 2 * chunks + 2 * n;
      f.per_tensor = norms + k * n;
      run.norm.finalize(f);
    }
    if (local_norms) return;
  }
  for (const kernels::TensorGroup& g : packed.groups) {
    p.group = &g;
    run.apply(p);
  }
}

}  // namespace mixprec::detail
