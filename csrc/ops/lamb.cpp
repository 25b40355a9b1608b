// Validation, scratch and pass sequencing for the fused LAMB op (declared in mixprec/optim_args.h;
// math in kernels/lamb.h):
// [global gradient norm] -> step increment -> moments pass -> per-tensor norms -> apply pass,
// all on the device's stream with no host synchronization; or, split for sharded tensors, the
// passes up to the per-tensor norms in one call and the apply pass in another.
#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "ops/optim.h"
#include "ops/optim_common.h"

namespace mixprec::detail {
namespace {

constexpr const char* kOp = "lamb_";

// local_norms / trust_norms: float32 [2, n], row 0 ||w|| and row 1 ||u|| per tensor.
void check_norms_shape(const char* arg, const at::Tensor& t, int64_t n) {
  MIXPREC_CHECK(t.defined(), arg_name(kOp, arg), " is undefined");
  MIXPREC_CHECK_VALUE(t.dim() == 2 && t.sym_size(0) == 2 && t.sym_size(1) == n, arg_name(kOp, arg),
                      " must have shape [2, ", num(n), "] (||w|| and ||u|| per tensor of params), got ",
                      shape(t.sym_sizes()));
}

void check_norms_storage(const char* arg, const at::Tensor& t, const at::Device& device) {
  MIXPREC_CHECK(t.device() == device, arg_name(kOp, arg), " is on ", t.device(), " but the op runs on ", device);
  MIXPREC_CHECK_TYPE(t.scalar_type() == at::kFloat, arg_name(kOp, arg), " has dtype ", t.scalar_type(),
                     "; expected float32");
  MIXPREC_CHECK(t.is_contiguous(), arg_name(kOp, arg), " is not contiguous");
}

// Checks that need no data: list lengths, the split step's norm shapes.
void check_shapes(const LambInputs& in) {
  const int64_t n = static_cast<int64_t>(in.params.size());
  for (const NamedList& l :
       {NamedList{"grads", in.grads}, NamedList{"exp_avgs", in.exp_avgs}, NamedList{"exp_avg_sqs", in.exp_avg_sqs}})
    MIXPREC_CHECK_VALUE(static_cast<int64_t>(l.tensors.size()) == n, arg_name(kOp, l.name), " has ",
                        num(l.tensors.size()), " tensors but params has ", num(n));
  MIXPREC_CHECK_VALUE(in.master_params.empty() || static_cast<int64_t>(in.master_params.size()) == n,
                      arg_name(kOp, "master_params"), " has ", num(in.master_params.size()), " tensors but params has ",
                      num(n));
  MIXPREC_CHECK_VALUE(!(in.local_norms && in.trust_norms), arg_name(kOp, "local_norms"),
                      " and trust_norms are the two halves of a split step: pass one of them, not both");
  if (in.local_norms) check_norms_shape("local_norms", *in.local_norms, n);
  if (in.trust_norms) check_norms_shape("trust_norms", *in.trust_norms, n);
}

}  // namespace

void lamb_impl(const LambInputs& in, const LambRunners& run, bool validate_only) {
  const LambArgs& a = in.args;
  const std::optional<at::Tensor>& global_grad_norm = in.global_grad_norm;
  const std::optional<at::Tensor>& local_norms = in.local_norms;
  const std::optional<at::Tensor>& trust_norms = in.trust_norms;
  check_range(kOp, "beta1", a.beta1, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "beta2", a.beta2, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "eps", a.eps, 0.0, INFINITY, true);
  check_range(kOp, "weight_decay", a.weight_decay, 0.0, INFINITY, true);
  // 0 (and inf) turn clipping off; Apex would divide every gradient by norm / 0 = inf.
  check_range(kOp, "max_grad_norm", a.max_grad_norm, 0.0, INFINITY);
  check_shapes(in);
  const bool trust_ratio = a.weight_decay != 0.0 || a.use_nvlamb;
  MIXPREC_CHECK_VALUE(trust_ratio || !(local_norms || trust_norms),
                      arg_name(kOp, local_norms ? "local_norms" : "trust_norms"),
                      ": a split step is for the trust ratio's norms, and this one takes none (weight_decay 0, "
                      "use_nvlamb false): it is one element-wise pass, call lamb_ once without them");
  if (nothing_to_step(kOp, in)) return;
  const at::Device device = op_device(kOp, {"params", in.params}, std::nullopt);
  const kernels::StepScalars scalars = step_scalars(kOp, device, in.step, a.bias_correction || a.stochastic_rounding);
  if (global_grad_norm) check_scalar_tensor(kOp, "global_grad_norm", *global_grad_norm, device);
  if (local_norms) check_norms_storage("local_norms", *local_norms, device);
  if (trust_norms) check_norms_storage("trust_norms", *trust_norms, device);

  const NamedList param_list{"params", in.params}, avg_list{"exp_avgs", in.exp_avgs},
      sq_list{"exp_avg_sqs", in.exp_avg_sqs};
  check_state_dtypes(kOp, avg_list, /*allow_bf16=*/false);
  check_state_dtypes(kOp, sq_list, false);
  const WeightLists weights =
      weight_lists(kOp, in.params, in.master_params, a.stochastic_rounding, a.seed, kernels::LambParams{}.weights);
  const NamedList master_list = weights.master_list(param_list);
  // An absent master list is stood in for by params: the kernels never touch it.
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(in.grads), avg_list, sq_list, master_list}, device, kInPlaceUpdate);
  // Everything is validated: from here on the op only runs.
  if (validate_only) return;

  const c10::DeviceGuard guard(device);
  // The apply pass recomputes u from the moments alone: the gradient and its clipping are done.
  const bool clip = a.max_grad_norm > 0.0 && std::isfinite(a.max_grad_norm) && !trust_norms;
  at::Tensor own_norm;  // kept alive until every pass is queued (stream-ordered on CUDA)
  const float* norm_ptr = nullptr;
  if (clip && global_grad_norm) {
    norm_ptr = global_grad_norm->data_ptr<float>();
  } else if (clip) {
    // The norm of the grads as given (still scaled): the kernels divide it by grad_scale.
    own_norm = std::get<0>(multi_tensor_norm_impl(in.grads, 2.0, /*per_tensor=*/false, run.norm));
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
  p.args = a;
  p.weights = weights.mode;
  p.global_grad_norm = norm_ptr;
  p.global_grad_norm_scaled = own_norm.defined();
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
    if (in.step.step_tensor) run.increment_step(step_tensor_ptr(in.step.step_tensor), scalars.found_inf);
    for (const kernels::TensorGroup& g : packed.groups) {
      set_group(p, g);
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
    set_group(p, g);
    run.apply(p);
  }
}

}  // namespace mixprec::detail
