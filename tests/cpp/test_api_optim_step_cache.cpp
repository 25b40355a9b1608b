// The lists a fused optimizer's step() reuses between steps (fused_optimizer_step.cpp), every
// family: after each kind of change to a param, grad, state tensor, group or option, the optimizer
// steps bit-identically to a fresh copy made after the change, and a misuse introduced after clean
// steps is still refused with its message before any group steps.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "api_support.h"
#include "optim_families.h"
#include "test_support.h"

namespace {

using namespace mixprec::test;
using namespace mixprec::test::api;
using namespace mixprec::optim;

// Group 0: fp32 params (one straddling the 65536-element chunk); group 1: fp16 params with fp32
// masters. Two clean steps first: one with new grad tensors, one writing into the same ones.
struct Trained {
  std::unique_ptr<FusedOptimizer> opt;

  Trained(const Family& f, const c10::Device& device) {
    Groups groups;
    groups.emplace_back(make_params({{65537}, {7}}, at::kFloat, device));
    groups.emplace_back(make_params({{5}, {3, 4}}, at::kHalf, device));
    opt = f.make(groups);
    step_new_grads(*opt);
    step_same_grads(*opt);
  }
  at::Tensor& param(size_t group, size_t i) { return opt->param_groups()[group].params()[i]; }
  std::vector<at::Tensor> params() const { return params_of(*opt); }

  static std::vector<at::Tensor> params_of(FusedOptimizer& o) {
    std::vector<at::Tensor> out;
    for (const auto& g : o.param_groups()) out.insert(out.end(), g.params().begin(), g.params().end());
    return out;
  }
  static void step_new_grads(FusedOptimizer& o) {
    const auto ps = params_of(o);
    set_grads(ps, random_grads(ps));
    o.step();
  }
  static void step_same_grads(FusedOptimizer& o) {
    torch::NoGradGuard no_grad;
    for (const auto& p : params_of(o))
      if (p.grad().defined()) p.mutable_grad().copy_(random_tensor(p.sizes(), at::kFloat, p.device()));
    o.step();
  }
  FusedParamState& state(const at::Tensor& p) {
    return static_cast<FusedParamState&>(*opt->state().at(p.unsafeGetTensorImpl()));
  }
  // NovoGrad keeps one second moment per param of a group: a group whose membership changed gets
  // its vector cut or extended (with zeros), as a user of it would have to.
  void fit_group_moments(size_t group) {
    auto* n = dynamic_cast<FusedNovoGrad*>(opt.get());
    if (n == nullptr) return;
    at::Tensor t = n->exp_avg_sq(group);
    const int64_t had = t.numel(), now = static_cast<int64_t>(opt->param_groups()[group].params().size());
    t.resize_({now});
    if (now > had) t.narrow(0, had, now - had).zero_();
  }
  // The first defined state tensor of p other than its master.
  at::Tensor& moment(const at::Tensor& p) {
    for (const auto& slot : state(p).slots())
      if (slot.second->defined() && std::string(slot.first) != "master_param") return *slot.second;
    throw std::runtime_error("no moment");
  }
};

// all_state with sparse grads made dense (a refused sparse grad is part of what must not change).
std::vector<at::Tensor> snapshot(FusedOptimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& t : all_state(opt)) out.push_back(t.is_sparse() ? t.to_dense() : t.clone());
  return out;
}

// Two steps of `a` and of a fresh copy of it (clone_base: the same state and options, no lists)
// with the same grads (new grad tensors, then the same ones written), compared bit for bit.
void expect_steps_like_fresh_copy(FusedOptimizer& a, const std::string& what) {
  std::vector<at::Tensor> qs;
  for (const auto& p : Trained::params_of(a)) qs.push_back(p.detach().clone().requires_grad_(true));
  std::unique_ptr<FusedOptimizer> b = a.clone_base(qs);
  for (int step = 0; step < 2; ++step) {
    const auto pa = Trained::params_of(a), pb = Trained::params_of(*b);
    const auto gs = random_grads(pa);
    for (size_t i = 0; i < pa.size(); ++i) {
      if (step == 0 || !pa[i].grad().defined()) {
        pa[i].mutable_grad() = gs[i].clone();
        pb[i].mutable_grad() = gs[i].clone();
      } else {
        torch::NoGradGuard no_grad;
        pa[i].mutable_grad().copy_(gs[i]);
        pb[i].mutable_grad().copy_(gs[i]);
      }
    }
    a.step();
    b->step();
    const auto sa = all_state(a), sb = all_state(*b);
    ASSERT_EQ(sa.size(), sb.size()) << what;
    for (size_t i = 0; i < sa.size(); ++i)
      EXPECT_TRUE(bitwise_equal(sa[i], sb[i])) << what << ": tensor " << i << " after step " << step;
  }
}

class ApiOptimStepCache : public FamiliesTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiOptimStepCache);

TEST_P(ApiOptimStepCache, AfterEveryKindOfChangeStepsLikeAFreshOptimizer) {
  struct Case {
    const char* what;
    std::function<void(Trained&)> change;
  };
  const c10::Device dev = device();
  const std::vector<Case> cases = {
      {"grads of the same tensors", [](Trained&) {}},
      {"a param replaced in its group (identity)",
       [dev](Trained& s) { s.param(1, 1) = random_tensor({3, 4}, at::kHalf, dev).requires_grad_(true); }},
      {"a param's storage replaced (same shape)",
       [dev](Trained& s) { s.param(0, 1).set_data(random_tensor({7}, at::kFloat, dev)); }},
      {"a param's dtype changed (fp32 to fp16: now it needs a master)",
       [](Trained& s) { s.param(0, 1).set_data(s.param(0, 1).detach().to(at::kHalf)); }},
      {"a param's shape changed, with state to match",
       [dev](Trained& s) {
         at::Tensor& p = s.param(1, 0);
         p.set_data(random_tensor({6}, at::kHalf, dev));
         s.opt->state().erase(p.unsafeGetTensorImpl());
       }},
      {"a param added to a group",
       [dev](Trained& s) {
         s.opt->param_groups()[0].params().push_back(random_tensor({4, 2}, at::kFloat, dev).requires_grad_(true));
         s.fit_group_moments(0);
       }},
      {"a param removed from a group",
       [](Trained& s) {
         s.opt->param_groups()[1].params().pop_back();
         s.fit_group_moments(1);
       }},
      {"a state tensor replaced by a copy (identity)",
       [](Trained& s) {
         at::Tensor& m = s.moment(s.param(0, 0));
         m = m.clone();
       }},
      {"a master replaced by a copy",
       [](Trained& s) { s.state(s.param(1, 1)).master_param(s.state(s.param(1, 1)).master_param().clone()); }},
      {"a master seeded through set_master",
       [dev](Trained& s) { s.opt->set_master(s.param(1, 0), random_tensor({5}, at::kFloat, dev)); }},
      {"a group moved to the CPU with its state (CUDA only)",
       [](Trained& s) {
         for (size_t i = 0; i < 2 && s.param(1, i).is_cuda(); ++i) {
           for (const auto& slot : s.state(s.param(1, i)).slots())
             if (slot.second->defined()) *slot.second = slot.second->cpu();
           s.param(1, i).set_data(s.param(1, i).detach().cpu());
         }
       }},
      {"a param's state dropped (made again)",
       [](Trained& s) { s.opt->state().erase(s.param(0, 1).unsafeGetTensorImpl()); }},
      {"master weights turned off in a group (its masters left in place)",
       [](Trained& s) { static_cast<FusedOptions&>(s.opt->param_groups()[1].options()).set_master_weights(false); }},
      {"the learning rate changed (as by a scheduler)",
       [](Trained& s) { s.opt->param_groups()[0].options().set_lr(s.opt->param_groups()[0].options().get_lr() * 3); }},
      {"a group's options replaced",
       [](Trained& s) { s.opt->param_groups()[0].set_options(s.opt->param_groups()[1].options().clone()); }},
      {"a group added",
       [dev](Trained& s) {
         s.opt->add_param_group(torch::optim::OptimizerParamGroup(
             std::vector<at::Tensor>{random_tensor({9}, at::kBFloat16, dev).requires_grad_(true)}));
       }},
      {"a checkpoint loaded",
       [](Trained& s) {
         const std::string bytes = save_to_string(*s.opt);
         Trained::step_new_grads(*s.opt);
         load_from_string(*s.opt, bytes);
       }},
  };
  for_each_family([&](const Family& f) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      Trained s(f, device());
      c.change(s);
      expect_steps_like_fresh_copy(*s.opt, c.what);
    }
  });
}

TEST_P(ApiOptimStepCache, AParamWithoutAGradThisStepIsLeftAndTakenBackNext) {
  for_each_family([&](const Family& f) {
    Trained s(f, device());
    s.param(0, 1).mutable_grad() = at::Tensor();
    // a grad-less param in the first step of the copy's too: no grad is given to it below
    std::vector<at::Tensor> qs;
    for (const auto& p : s.params()) qs.push_back(p.detach().clone().requires_grad_(true));
    auto b = s.opt->clone_base(qs);
    for (int step = 0; step < 3; ++step) {
      const auto pa = s.params(), pb = Trained::params_of(*b);
      const auto gs = random_grads(pa);
      for (size_t i = 0; i < pa.size(); ++i) {
        const bool skip = step == 0 && i == 1;  // params[1] is group 0's second
        pa[i].mutable_grad() = skip ? at::Tensor() : gs[i].clone();
        pb[i].mutable_grad() = skip ? at::Tensor() : gs[i].clone();
      }
      s.opt->step();
      b->step();
      const auto sa = all_state(*s.opt), sb = all_state(*b);
      ASSERT_EQ(sa.size(), sb.size());
      for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(bitwise_equal(sa[i], sb[i])) << "step " << step << " " << i;
    }
  });
}

TEST_P(ApiOptimStepCache, AMisuseAfterCleanStepsIsRefusedWithItsMessageAndChangesNothing) {
  // Each spoils group 1 (or, where only the op can tell, group 0 alone) after two clean steps
  // built the lists; a step trusting them would run group 0 before group 1's op threw.
  struct Case {
    const char* what;
    std::function<void(Trained&)> spoil;
    std::vector<std::string> needles;
  };
  const c10::Device dev = device();
  const std::vector<Case> cases = {
      {"grad of another dtype",
       [](Trained& s) { s.param(1, 0).mutable_grad() = s.param(1, 0).grad().to(at::kDouble); },
       {"param_groups[1]: params[0].grad has dtype", "expected float32, float16 or bfloat16"}},
      {"grad of another shape",
       [dev](Trained& s) {
         s.param(1, 1).mutable_grad() = torch::zeros({12}, at::TensorOptions(at::kHalf).device(dev));
       },
       {"param_groups[1]: params[1].grad has shape [12]", "expected the parameter's [3, 4]"}},
      {"grad resized in place",
       [](Trained& s) { s.param(1, 1).mutable_grad().resize_({12}); },
       {"param_groups[1]: params[1].grad has shape [12]"}},
      {"sparse grad",
       [](Trained& s) { s.param(1, 0).mutable_grad() = s.param(1, 0).grad().to_sparse(); },
       {"does not support sparse gradients (param group 1)"}},
      {"param of another shape (its grad no longer fits)",
       [dev](Trained& s) { s.param(1, 0).set_data(random_tensor({6}, at::kHalf, dev)); },
       {"param_groups[1]: params[0]", "has shape [5]"}},
      {"param relaid out (state no longer fits)",
       [](Trained& s) {
         at::Tensor& p = s.param(1, 1);
         p.set_data(p.detach().t().contiguous().t());
         p.mutable_grad() = p.grad().t().contiguous().t();
       },
       {"param_groups[1]: params[1] state['", "expected the parameter's layout"}},
      {"param of another dtype",
       [](Trained& s) { s.param(1, 0).set_data(s.param(1, 0).detach().to(at::kDouble)); },
       {"param_groups[1]: params[0] has dtype", "expected float32, float16 or bfloat16"}},
      {"param moved to another device (CUDA only: the group then mixes devices)",
       [](Trained& s) {
         if (s.param(1, 0).is_cuda()) {
           s.param(1, 0).set_data(s.param(1, 0).detach().cpu());
           s.param(1, 0).mutable_grad() = s.param(1, 0).grad().cpu();
         } else {  // nothing to move to: the same refusal another way
           s.param(1, 0).mutable_grad() = s.param(1, 0).grad().to(at::kDouble);
         }
       },
       {"param_groups[1]"}},
      {"state tensor of another dtype",
       [](Trained& s) { s.moment(s.param(1, 1)) = s.moment(s.param(1, 1)).to(at::kDouble); },
       {"param_groups[1]: params[1] state['"}},
      {"overlapping params in one group (the op's own check)",
       [](Trained& s) {
         at::Tensor& p = s.param(0, 1);
         p.set_data(s.param(0, 0).detach().narrow(0, 3, 7));
       },
       {"shares memory with"}},
  };
  for_each_family([&](const Family& f) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      Trained s(f, device());
      for (const auto& p : s.params()) p.mutable_grad() = random_grads({p})[0];
      c.spoil(s);
      const auto before = snapshot(*s.opt);
      expect_c10_error([&] { s.opt->step(); }, c.needles);
      expect_unchanged(snapshot(*s.opt), before, c.what);
      // Still refused on the next attempt (a refused step builds no lists to trust).
      expect_c10_error([&] { s.opt->step(); }, c.needles);
    }
  });
}

}  // namespace
