// Helpers of the C++ front's misuse tests (test_api_*_misuse.cpp): params and grads, every state
// tensor of an optimizer for bitwise "nothing changed" checks, and in-memory checkpoints.
#pragma once

#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "test_support.h"

namespace mixprec::test::api {

inline std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& sh, at::ScalarType dtype,
                                           const c10::Device& device) {
  std::vector<at::Tensor> ps;
  for (const auto& s : sh) ps.push_back(random_tensor(s, dtype, device).requires_grad_(true));
  return ps;
}

// Leaf copies of `ps` (same dtype and device).
inline std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Fresh random gradients, one per param in its dtype, times `factor`.
inline std::vector<at::Tensor> random_grads(const std::vector<at::Tensor>& ps, double factor = 1.0) {
  std::vector<at::Tensor> gs;
  for (const auto& p : ps)
    gs.push_back((random_tensor(p.sizes(), at::kFloat, p.device()) * factor).to(p.scalar_type()));
  return gs;
}

inline void set_grads(const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs) {
  for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = gs[i].clone();
}

// Every param, grad, state tensor (masters included), step count and group tensor (NovoGrad's
// norms) of `opt`, in order.
inline std::vector<at::Tensor> all_state(mixprec::optim::FusedOptimizer& opt) {
  std::vector<at::Tensor> out;
  const auto* novograd = dynamic_cast<const mixprec::optim::FusedNovoGrad*>(&opt);
  for (size_t i = 0; i < opt.param_groups().size(); ++i) {
    const at::Tensor step = opt.step_count_tensor(i);
    if (step.defined()) out.push_back(step);
    const at::Tensor norms = novograd != nullptr ? novograd->exp_avg_sq(i) : at::Tensor();
    if (norms.defined()) out.push_back(norms);
    for (const auto& p : opt.param_groups()[i].params()) {
      out.push_back(p.detach());
      if (p.grad().defined()) out.push_back(p.grad());
      const auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      for (const auto& kv : static_cast<mixprec::optim::FusedParamState&>(*it->second).defined_tensors())
        out.push_back(kv.second);
    }
  }
  return out;
}

// Every group's learning rate (the option a scheduler changes), for "options unchanged" checks.
inline std::vector<double> all_lrs(const torch::optim::Optimizer& opt) {
  std::vector<double> out;
  for (const auto& g : opt.param_groups()) out.push_back(g.options().get_lr());
  return out;
}

template <class T> std::string save_to_string(const T& obj) {
  torch::serialize::OutputArchive archive;
  obj.save(archive);
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

template <class T> void load_from_string(T& obj, const std::string& bytes) {
  torch::serialize::InputArchive archive;
  std::istringstream is(bytes);
  archive.load_from(is);
  obj.load(archive);
}

}  // namespace mixprec::test::api
