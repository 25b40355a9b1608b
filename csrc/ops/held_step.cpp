// The held optimizer step and global gradient norm (see held_step.h), and their TorchScript
// classes torch.classes.mixprec.HeldStep and HeldNorm.
#include "ops/held_step.h"

#include <mixprec/ops.h>  // non_finite_check_and_unscale_, multi_tensor_norm

#include <torch/library.h>

#include "ops/device_copy.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {

namespace {

constexpr const char* kWhat = "mixprec.HeldStep";

c10::OperatorHandle find_optim_op(const std::string& name) {
  const auto op = c10::Dispatcher::singleton().findSchema({"mixprec::" + name, ""});
  MIXPREC_CHECK_VALUE(op.has_value(), kWhat, ": no op mixprec::", name, "; expected an optimizer family (adam, sgd, ",
                      "lamb, adagrad, novograd)");
  return *op;
}

}  // namespace

HeldStep::HeldStep(const std::string& family, const std::vector<at::Tensor>& tensors,
                   const std::vector<int64_t>& lengths, const c10::List<std::optional<at::Tensor>>& optionals,
                   const std::vector<double>& floats, const std::vector<int64_t>& ints,
                   const std::vector<int64_t>& bools, const std::vector<std::string>& per_step)
    : family_(family), op_(find_optim_op(family + "_")), check_op_(find_optim_op(family + "_check")) {
  // The arguments come split by kind; the schema says where each goes.
  size_t t = 0, l = 0, o = 0, f = 0, i = 0, b = 0;
  const auto take = [&](size_t& at, size_t size, const char* kind) {
    MIXPREC_CHECK_VALUE(at < size, kWhat, ": too few ", kind, " arguments for mixprec::", family, "_");
    return at++;
  };
  for (const c10::Argument& arg : op_.schema().arguments()) {
    const c10::TypePtr& type = arg.type();
    if (type->kind() == c10::TypeKind::ListType) {
      MIXPREC_CHECK_VALUE(type->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::TensorType, kWhat,
                          ": argument ", arg.name(), " of mixprec::", family, "_ is a list of non-tensors");
      const int64_t n = lengths.at(take(l, lengths.size(), "list"));
      MIXPREC_CHECK_VALUE(n >= 0 && t + static_cast<size_t>(n) <= tensors.size(), kWhat, ": list ", arg.name(),
                          " runs past the tensors given");
      stack_.emplace_back(c10::List<at::Tensor>(std::vector<at::Tensor>(tensors.begin() + t, tensors.begin() + t + n)));
      t += static_cast<size_t>(n);
    } else if (type->kind() == c10::TypeKind::TensorType) {
      stack_.emplace_back(tensors.at(take(t, tensors.size(), "tensor")));
    } else if (type->kind() == c10::TypeKind::OptionalType) {
      stack_.emplace_back(optionals.get(take(o, optionals.size(), "optional tensor")));
    } else if (type->kind() == c10::TypeKind::FloatType) {
      stack_.emplace_back(floats[take(f, floats.size(), "float")]);
    } else if (type->kind() == c10::TypeKind::IntType) {
      stack_.emplace_back(ints[take(i, ints.size(), "int")]);
    } else if (type->kind() == c10::TypeKind::BoolType) {
      stack_.emplace_back(bools[take(b, bools.size(), "bool")] != 0);
    } else {
      MIXPREC_CHECK_VALUE(false, kWhat, ": argument ", arg.name(), " of mixprec::", family,
                          "_ has a type it cannot hold");
    }
  }
  MIXPREC_CHECK_VALUE(t == tensors.size() && l == lengths.size() && o == optionals.size() && f == floats.size() &&
                          i == ints.size() && b == bools.size(),
                      kWhat, ": more arguments than mixprec::", family, "_ takes");
  grads_at_ = index_of("grads");
  step_tensor_at_ = index_of("step_tensor");
  lr_at_ = index_of("lr");
  lr_tensor_at_ = index_of("lr_tensor");
  grad_scale_at_ = index_of("grad_scale");
  found_inf_at_ = index_of("found_inf");
  for (const std::string& name : per_step) per_step_at_.push_back(index_of(name));
  params_ = stack_[index_of("params")].toTensorVector();
  MIXPREC_CHECK_VALUE(!params_.empty(), kWhat, ": params is empty; a step over nothing needs no held step");
  device_ = params_[0].device();
  for (const at::Tensor& p : params_) dtypes_.push_back(p.scalar_type());
  // What each step passes anew is not held: grads kept here would outlive zero_grad(set_to_none).
  stack_[grads_at_] = c10::List<at::Tensor>();
  for (size_t at : {step_tensor_at_, lr_tensor_at_, grad_scale_at_, found_inf_at_}) stack_[at] = c10::IValue();
  for (size_t at : per_step_at_) stack_[at] = c10::IValue();
}

size_t HeldStep::index_of(const std::string& name) const {
  const auto index = op_.schema().argumentIndexWithName(name);
  MIXPREC_CHECK_VALUE(index.has_value(), kWhat, ": mixprec::", family_, "_ has no argument ", name);
  return *index;
}

std::optional<c10::List<at::Tensor>> HeldStep::current_grads() const {
  c10::List<at::Tensor> grads;
  grads.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    // The checks of the caller's regular path (optimizers/_step_cache.regular_params): a param
    // without a grad, a sparse grad, a param moved elsewhere or given another dtype (whose
    // checks the caller makes in Python: lean masters) is the fully checked path's case.
    const at::Tensor& p = params_[i];
    const at::Tensor& g = p.grad();
    if (!g.defined() || g.layout() != at::kStrided || p.device() != device_ || p.scalar_type() != dtypes_[i])
      return std::nullopt;
    grads.push_back(g);
  }
  return grads;
}

bool HeldStep::step(std::optional<at::Tensor> step_tensor, double lr, std::optional<at::Tensor> lr_tensor,
                    std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
                    c10::List<std::optional<at::Tensor>> extras, bool validate_only, bool check_inf) {
  MIXPREC_CHECK_VALUE(extras.size() == per_step_at_.size(), kWhat, ".step: ", num(extras.size()),
                      " extra tensors given; expected ", num(per_step_at_.size()));
  MIXPREC_CHECK_VALUE(!check_inf || (found_inf && grad_scale), kWhat,
                      ".step: check_inf needs found_inf and grad_scale (the scale)");
  std::optional<c10::List<at::Tensor>> grads = current_grads();
  if (!grads) return false;
  if (check_inf) check_grads(grads->vec(), *found_inf, grad_scale);
  std::vector<c10::IValue> stack = stack_;
  stack[grads_at_] = std::move(*grads);
  stack[step_tensor_at_] = std::move(step_tensor);
  stack[lr_at_] = lr;
  stack[lr_tensor_at_] = std::move(lr_tensor);
  stack[grad_scale_at_] = std::move(grad_scale);
  stack[found_inf_at_] = std::move(found_inf);
  for (size_t k = 0; k < per_step_at_.size(); ++k) stack[per_step_at_[k]] = extras.get(k);
  (validate_only ? check_op_ : op_).callBoxed(&stack);
  return true;
}

bool HeldStep::check_inf(at::Tensor found_inf, std::optional<at::Tensor> scale) {
  std::optional<c10::List<at::Tensor>> grads = current_grads();
  if (!grads) return false;
  check_grads(grads->vec(), found_inf, scale);
  return true;
}

void HeldStep::check_grads(std::vector<at::Tensor> tensors, const at::Tensor& found_inf,
                           const std::optional<at::Tensor>& scale) {
  non_finite_check_and_unscale_(tensors, found_inf);
  if (scale) {
    // The reciprocal in float64, as torch's scaler takes it; log(1/scale) is finite exactly when
    // the float32 reciprocal is finite and > 0 (the Python scaler's flag_unusable_scale). A call
    // of its own: the grads' call then repeats exactly and reuses its packing (pack_lists).
    non_finite_check_and_unscale_({scale->to(at::kDouble).reciprocal().to(at::kFloat).log().reshape({1})}, found_inf);
  }
}

HeldNorm::HeldNorm(const std::vector<at::Tensor>& params, const std::vector<int64_t>& lengths) {
  size_t start = 0;
  for (const int64_t n : lengths) {
    MIXPREC_CHECK_VALUE(n > 0 && start + static_cast<size_t>(n) <= params.size(), "mixprec.HeldNorm: lengths ", num(n),
                        " at params[", num(start), "] of ", num(params.size()),
                        "; expected positive lengths summing to the params given");
    params_.emplace_back(params.begin() + static_cast<std::ptrdiff_t>(start),
                         params.begin() + static_cast<std::ptrdiff_t>(start + static_cast<size_t>(n)));
    devices_.push_back(params[start].device());
    for (const at::Tensor& p : params_.back())
      MIXPREC_CHECK_VALUE(p.device() == devices_.back(), "mixprec.HeldNorm: params[", num(start), "...] mix devices ",
                          devices_.back().str(), " and ", p.device().str(), "; expected one device per length");
    start += static_cast<size_t>(n);
  }
  MIXPREC_CHECK_VALUE(start == params.size() && !params_.empty(), "mixprec.HeldNorm: lengths sum to ", num(start),
                      " but ", num(params.size()), " params given; expected them equal and not 0");
}

std::vector<at::Tensor> HeldNorm::norms(std::optional<at::Tensor> grad_scale) const {
  std::vector<std::vector<at::Tensor>> grads(params_.size());
  for (size_t d = 0; d < params_.size(); ++d) {
    grads[d].reserve(params_[d].size());
    for (const at::Tensor& p : params_[d]) {
      // The checked path groups grads by their device and refuses sparse ones (with its own
      // error): both are its cases, as a missing grad is.
      const at::Tensor& g = p.grad();
      if (!g.defined() || g.layout() != at::kStrided || g.device() != devices_[d] || p.device() != devices_[d])
        return {};
      grads[d].push_back(g);
    }
  }
  const at::Device first = devices_[0];
  at::Tensor total;
  if (grads.size() == 1) {
    total = std::get<0>(mixprec::multi_tensor_norm(grads[0])).reshape({1});
  } else {  // several devices: the squares combined on the first, as the checked path does
    std::vector<at::Tensor> partial;
    for (const auto& list : grads) partial.push_back(to_device(std::get<0>(mixprec::multi_tensor_norm(list)), first));
    total = at::stack(partial).square().sum().sqrt().reshape({1});
  }
  if (grad_scale) {
    // In place on the norm just made: the kernel of the checked path's `total / scale` (the same
    // bits), without a new tensor (and, on the meta device, without torch's Python meta function).
    const at::Tensor scale = to_device(*grad_scale, first, at::kFloat);
    total.div_(scale.dim() != 1 ? scale.reshape({1}) : scale);
  }
  std::vector<at::Tensor> out{total};
  for (size_t d = 1; d < devices_.size(); ++d) out.push_back(to_device(total, devices_[d]));
  return out;
}

TORCH_LIBRARY_FRAGMENT(mixprec, m) {
  m.class_<HeldStep>("HeldStep")
      .def(torch::init<std::string, std::vector<at::Tensor>, std::vector<int64_t>, c10::List<std::optional<at::Tensor>>,
                       std::vector<double>, std::vector<int64_t>, std::vector<int64_t>, std::vector<std::string>>())
      .def("step", &HeldStep::step)
      .def("check_inf", &HeldStep::check_inf)
      .def("num_params", &HeldStep::num_params);
  m.class_<HeldNorm>("HeldNorm")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("norms", &HeldNorm::norms);
}

}  // namespace mixprec::detail
