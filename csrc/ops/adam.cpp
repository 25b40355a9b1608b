// Validation and packing for the fused Adam/AdamW op (declared in mixprec/optim_args.h); the
// kernels run through each backend's AdamRunners (ops/optim.h).

#include <cmath>

#include "kernels/quant8.h"
#include "ops/optim.h"
#include "ops/optim_common.h"

namespace mixprec::detail {
namespace {

// 8-bit codes: `dtype`, on `device`, shaped and laid out like params[i] (the kernels walk an
// entry's tensors together in storage order, and quantization blocks run along it).
void check_codes(const char* op, const NamedList& list, at::ScalarType dtype, const char* dtype_name,
                 const NamedList& params, const at::Device& device) {
  for (size_t k = 0; k < list.tensors.size(); ++k) {
    const auto i = static_cast<int64_t>(k);
    const at::Tensor& t = list.tensors[k];
    const at::Tensor& p = params.tensors[k];
    const auto what = [&] { return arg_name(op, list.name, i); };
    MIXPREC_CHECK(t.defined(), what(), " is undefined");
    MIXPREC_CHECK(t.device() == device, what(), " is on ", t.device().str(), " but the op runs on ", device.str());
    MIXPREC_CHECK_TYPE(t.scalar_type() == dtype, what(), " has dtype ", t.scalar_type(), "; expected ", dtype_name,
                       " codes (8-bit moments: exp_avg_scales and exp_avg_sq_scales are given)");
    MIXPREC_CHECK_VALUE(t.sizes().equals(p.sizes()), what(), " has shape ", shape(t.sizes()), " but ",
                        arg_name(op, params.name, i), " has shape ", shape(p.sizes()));
    bool same = t.is_non_overlapping_and_dense();
    for (int64_t d = 0; same && d < t.dim(); ++d) same = t.size(d) <= 1 || t.stride(d) == p.stride(d);
    MIXPREC_CHECK_VALUE(same, what(), " has strides ", shape(t.strides()), " but ", arg_name(op, params.name, i),
                        " has strides ", shape(p.strides()),
                        "; codes need their parameter's layout (torch.zeros_like(p, dtype=torch.int8))");
  }
}

// One float32 scale per quantization block of params[i], contiguous.
void check_scales(const char* op, const NamedList& list, const NamedList& params, const at::Device& device) {
  for (size_t k = 0; k < list.tensors.size(); ++k) {
    const auto i = static_cast<int64_t>(k);
    const at::Tensor& t = list.tensors[k];
    const auto what = [&] { return arg_name(op, list.name, i); };
    const int64_t blocks = kernels::quant_blocks(params.tensors[k].numel());
    MIXPREC_CHECK(t.defined(), what(), " is undefined");
    MIXPREC_CHECK(t.device() == device, what(), " is on ", t.device().str(), " but the op runs on ", device.str());
    MIXPREC_CHECK_TYPE(t.scalar_type() == at::kFloat, what(), " has dtype ", t.scalar_type(), "; expected float32");
    MIXPREC_CHECK_VALUE(t.numel() == blocks && t.is_contiguous(), what(), " has shape ", shape(t.sizes()),
                        t.is_contiguous() ? "" : " (not contiguous)", "; expected a contiguous float32 tensor of ",
                        num(blocks), " elements, one per ", num(kernels::kQuantBlock), " of ",
                        arg_name(op, params.name, i), "'s ", num(params.tensors[k].numel()));
  }
}

}  // namespace

void adam_impl(const AdamInputs& in, const AdamRunners& run, bool validate_only) {
  constexpr const char* kOp = "adam_";
  const AdamArgs& a = in.args;
  check_range(kOp, "beta1", a.beta1, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "beta2", a.beta2, 0.0, 1.0, /*hi_open=*/true);
  check_range(kOp, "eps", a.eps, 0.0, INFINITY, true);
  check_range(kOp, "weight_decay", a.weight_decay, 0.0, INFINITY, true);
  if (nothing_to_step(kOp, in)) return;
  const at::Device device = op_device(kOp, {"params", in.params}, std::nullopt);
  const kernels::StepScalars scalars = step_scalars(kOp, device, in.step, a.bias_correction || a.stochastic_rounding);

  const NamedList param_list{"params", in.params}, avg_list{"exp_avgs", in.exp_avgs},
      sq_list{"exp_avg_sqs", in.exp_avg_sqs}, avg_scales{"exp_avg_scales", in.exp_avg_scales},
      sq_scales{"exp_avg_sq_scales", in.exp_avg_sq_scales};
  const bool amsgrad = present(in.max_exp_avg_sqs);
  const bool quant8 = present(in.exp_avg_scales) || present(in.exp_avg_sq_scales);
  if (quant8) {
    for (const NamedList* l : {&avg_list, &sq_list, &avg_scales, &sq_scales})
      MIXPREC_CHECK_VALUE(l->tensors.size() == in.params.size(), arg_name(kOp, l->name), " has ",
                          num(l->tensors.size()), " tensors but params has ", num(in.params.size()),
                          "; 8-bit moments need codes and scales for every param");
    MIXPREC_CHECK_VALUE(!amsgrad, arg_name(kOp, "max_exp_avg_sqs"),
                        " must be empty with 8-bit moments (exp_avg_scales given): amsgrad keeps no 8-bit "
                        "maximum; use float32 or bfloat16 moments with amsgrad");
    check_codes(kOp, avg_list, at::kChar, "int8", param_list, device);
    check_codes(kOp, sq_list, at::kByte, "uint8", param_list, device);
    check_scales(kOp, avg_scales, param_list, device);
    check_scales(kOp, sq_scales, param_list, device);
  } else {
    check_state_dtypes(kOp, avg_list, /*allow_bf16=*/true);
    check_state_dtypes(kOp, sq_list, true, &avg_list);
  }
  const WeightLists weights =
      weight_lists(kOp, in.params, in.master_params, a.stochastic_rounding, a.seed, kernels::AdamParams{}.weights);
  const NamedList max_list = amsgrad ? NamedList{"max_exp_avg_sqs", in.max_exp_avg_sqs} : param_list;
  const NamedList master_list = weights.master_list(param_list);
  if (amsgrad) check_state_dtypes(kOp, max_list, true, &avg_list);

  // Absent lists are stood in for by params: the kernels never touch them (see kernels/adam.h).
  // 8-bit codes, checked above, are packed as stand-ins too (pack_lists takes float lists shaped
  // like params) and put in place below; the overlap check then covers them and the scales.
  PackedLists packed;
  if (quant8) {
    packed = pack_lists(kOp, {param_list, grad_list(in.grads), param_list, param_list, param_list, master_list}, device,
                        {/*dense_layouts=*/true, /*refuse_overlap=*/false});
    check_no_overlap(kOp, {param_list, grad_list(in.grads), avg_list, sq_list, avg_scales, sq_scales, master_list});
  } else {
    packed = pack_lists(kOp, {param_list, grad_list(in.grads), avg_list, sq_list, max_list, master_list}, device,
                        kInPlaceUpdate);
  }
  if (validate_only) return;
  if (quant8) {
    for (kernels::TensorGroup& g : packed.groups) {
      g.num_lists = kernels::kAdamQ8Lists;
      g.dtypes[kernels::kAdamExpAvgScale] = g.dtypes[kernels::kAdamExpAvgSqScale] = kernels::DType::kFloat32;
      for (int64_t j = 0; j < g.size(); ++j) {
        const int32_t i = g.index[j];
        g.ptrs[kernels::kAdamExpAvg][j] = in.exp_avgs[i].data_ptr();
        g.ptrs[kernels::kAdamExpAvgSq][j] = in.exp_avg_sqs[i].data_ptr();
        g.ptrs[kernels::kAdamExpAvgScale].push_back(in.exp_avg_scales[i].data_ptr());
        g.ptrs[kernels::kAdamExpAvgSqScale].push_back(in.exp_avg_sq_scales[i].data_ptr());
      }
    }
  }

  kernels::AdamParams p;
  p.scalars = scalars;
  p.args = a;
  p.one_minus_beta1 = static_cast<float>(1.0 - a.beta1);
  p.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  p.log_beta1 = static_cast<float>(std::log(a.beta1));  // -inf for beta1 = 0: bias correction 1
  p.log_beta2 = static_cast<float>(std::log(a.beta2));
  p.amsgrad = amsgrad;
  p.quant8 = quant8;
  p.weights = weights.mode;
  run_update(run, packed, device, in.step, p);
}

}  // namespace mixprec::detail
