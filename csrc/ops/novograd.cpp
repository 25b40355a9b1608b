// Validation and packing for the fused NovoGrad op (declared in mixprec/optim_args.h): gradient
// norms through the norm machinery, then the moment update and the element-wise pass, all on the
// op's device, through each backend's NovoGradRunners (ops/optim.h).
#include <c10/core/DeviceGuard.h>

#include <cmath>
#include <vector>

#include "ops/optim.h"
#include "ops/optim_common.h"

namespace mixprec::detail {
namespace {

constexpr const char* kOp = "novograd_";

kernels::NormType novograd_norm_type(double norm_type) {
  if (norm_type == 2.0) return kernels::NormType::kL2;
  if (std::isinf(norm_type) && norm_type > 0) return kernels::NormType::kInf;
  MIXPREC_CHECK_VALUE(false, arg_name(kOp, "norm_type"), " must be 2 or inf, got ", num(norm_type),
                      " (Apex's norm_type=0 for the infinity norm is translated by FusedNovoGrad)");
  return kernels::NormType::kL2;  // unreachable
}

// The grads of every packed group, regrouped by grad dtype alone (one list), for the norm
// partials; each tensor keeps its global first chunk, so partials land where the finalize reads.
std::vector<kernels::TensorGroup> grad_groups(const PackedLists& packed) {
  std::vector<kernels::TensorGroup> out;
  int slot[3] = {-1, -1, -1};
  for (const kernels::TensorGroup& g : packed.groups) {
    const kernels::DType d = g.dtypes[kernels::kNovoGradGrad];
    int& s = slot[static_cast<int>(d)];
    if (s < 0) {
      s = static_cast<int>(out.size());
      kernels::TensorGroup ng;
      ng.num_lists = 1;
      ng.dtypes[0] = d;
      out.push_back(std::move(ng));
    }
    for (int64_t i = 0; i < g.size(); ++i) {
      void* ptr = g.ptrs[kernels::kNovoGradGrad][i];
      out[s].add(g.index[i], g.numel[i], &ptr, g.first_chunk[i]);
    }
  }
  return out;
}

void check_list_length(const char* name, int64_t got, int64_t n, const char* hint) {
  MIXPREC_CHECK_VALUE(got == n, arg_name(kOp, name), " has ", num(got), " tensors but params", " has ", num(n), hint);
}

// A float32 vector of one value per tensor of params (exp_avg_sq_norms, grad_norms): its shape,
// symbolically, since the Meta impl sees torch.compile's fake tensors.
void check_per_tensor_shape(const char* arg, const at::Tensor& t, int64_t n, const char* meaning) {
  const std::string what = arg_name(kOp, arg);
  MIXPREC_CHECK(t.defined(), what, " is undefined");
  MIXPREC_CHECK_VALUE(t.dim() == 1 && t.sym_numel() == n, what, " must have shape [", num(n), "] (", meaning, "), got ",
                      shape(t.sym_sizes()));
}

// ... and its storage, once the op's device is known.
void check_per_tensor_storage(const char* arg, const at::Tensor& t, const at::Device& device) {
  const std::string what = arg_name(kOp, arg);
  MIXPREC_CHECK(t.device() == device, what, " is on ", t.device(), " but the op runs on ", device);
  MIXPREC_CHECK_TYPE(t.scalar_type() == at::kFloat, what, " has dtype ", t.scalar_type(), "; expected float32");
  MIXPREC_CHECK(t.is_contiguous(), what, " is not contiguous");
}

// Checks that need no data: list lengths, the per-tensor vectors' shapes.
void check_shapes(const NovoGradInputs& in) {
  // Plain calls rather than a loop over a braced list: built with GCC 13.3 against torch 2.11, a
  // length error thrown from such a loop here crashed the process (cause not established).
  const int64_t n = static_cast<int64_t>(in.params.size());
  check_list_length("grads", static_cast<int64_t>(in.grads.size()), n, "");
  check_list_length("exp_avgs", static_cast<int64_t>(in.exp_avgs.size()), n, "");
  if (!in.master_params.empty())
    check_list_length("master_params", static_cast<int64_t>(in.master_params.size()), n,
                      " (pass an empty list for no master weights)");
  check_per_tensor_shape("exp_avg_sq_norms", in.exp_avg_sq_norms, n, "one second moment per tensor of params");
  if (in.grad_norms) check_per_tensor_shape("grad_norms", *in.grad_norms, n, "one gradient norm per tensor of params");
}

}  // namespace

void novograd_impl(const NovoGradInputs& in, const NovoGradRunners& run, bool validate_only) {
  const NovoGradArgs& a = in.args;
  const at::Tensor& exp_avg_sq_norms = in.exp_avg_sq_norms;
  const std::optional<at::Tensor>& given_grad_norms = in.grad_norms;
  // Everything is checked before anything runs, so a rejected call modifies nothing.
  check_range(kOp, "beta1", a.beta1, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "beta2", a.beta2, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "eps", a.eps, 0.0, INFINITY, true);
  check_range(kOp, "weight_decay", a.weight_decay, 0.0, INFINITY, true);
  const kernels::NormType type = novograd_norm_type(a.norm_type);
  check_shapes(in);
  if (nothing_to_step(kOp, in)) return;

  const at::Device device = op_device(kOp, {"params", in.params}, std::nullopt);
  // The step count is needed for bias correction and, without init_zero, to know the first step.
  const kernels::StepScalars scalars =
      step_scalars(kOp, device, in.step, /*needs_step=*/a.bias_correction || !a.init_zero || a.stochastic_rounding);
  check_per_tensor_storage("exp_avg_sq_norms", exp_avg_sq_norms, device);
  if (given_grad_norms) check_per_tensor_storage("grad_norms", *given_grad_norms, device);

  const NamedList param_list{"params", in.params}, avg_list{"exp_avgs", in.exp_avgs};
  check_state_dtypes(kOp, avg_list, /*allow_bf16=*/false);
  const WeightLists weights =
      weight_lists(kOp, in.params, in.master_params, a.stochastic_rounding, a.seed, kernels::NovoGradParams{}.weights);
  const NamedList master_list = weights.master_list(param_list);
  // Without master weights, params stand in for the master list: the kernels never touch it.
  const PackedLists packed =
      pack_lists(kOp, {param_list, grad_list(in.grads), avg_list, master_list}, device, kInPlaceUpdate);
  if (validate_only) return;

  const c10::DeviceGuard guard(device);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  // Per-tensor norms of the grads as stored (the moment update unscales them), unless given.
  // Empty tensors get no kernel: their norm is this zero, and their v is still blended, as in Apex.
  at::Tensor grad_norms = given_grad_norms ? *given_grad_norms : at::zeros({packed.num_tensors}, opts);
  if (!given_grad_norms && packed.total_chunks > 0) {
    at::Tensor partials = at::empty({packed.total_chunks}, opts);
    at::Tensor total = at::empty({}, opts);  // the finalize always writes it; unused here
    for (const kernels::TensorGroup& g : grad_groups(packed)) {
      kernels::NormParams np;
      np.group = &g;
      np.type = type;
      np.partials = partials.data_ptr<float>();
      run.norm.partials(np);
    }
    kernels::NormFinalizeParams f;
    f.all = &packed.all;
    f.type = type;
    f.partials = partials.data_ptr<float>();
    f.total_chunks = packed.total_chunks;
    f.total = total.data_ptr<float>();
    f.per_tensor = grad_norms.data_ptr<float>();
    run.norm.finalize(f);
  }

  if (in.step.step_tensor) run.increment_step(step_tensor_ptr(in.step.step_tensor), scalars.found_inf);

  kernels::NovoGradMomentParams mp;
  mp.grad_norms = grad_norms.data_ptr<float>();
  mp.exp_avg_sq_norms = exp_avg_sq_norms.data_ptr<float>();
  mp.num_tensors = packed.num_tensors;
  mp.type = type;
  mp.args = a;
  mp.scalars = scalars;
  run.moment(mp);

  kernels::NovoGradParams p;
  p.scalars = scalars;
  p.exp_avg_sq_norms = exp_avg_sq_norms.data_ptr<float>();
  p.args = a;
  p.weights = weights.mode;
  for (const kernels::TensorGroup& g : packed.groups) {
    set_group(p, g);
    run.step(p);
  }
}

}  // namespace mixprec::detail
