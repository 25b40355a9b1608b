// Misuse of the C++ fused optimizers, every family (issue 20): a step refused for any group's
// options, grads or state changes no group; checkpoints with bad step counts are refused and
// change nothing; clone() trains bit-identically to its source and independently of it.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>

#include "api_support.h"
#include "optim_families.h"
#include "test_support.h"

namespace {

using namespace mixprec::test;
using namespace mixprec::test::api;
using namespace mixprec::optim;

// Group 0: fp32 params; group 1: fp16 params with fp32 masters; a chunk-straddling size in each.
struct TwoGroups {
  std::vector<at::Tensor> g0, g1;
  std::unique_ptr<FusedOptimizer> opt;

  TwoGroups(const Family& f, const c10::Device& device, int steps = 1)
      : g0(make_params({{65537}, {7}}, at::kFloat, device)), g1(make_params({{5}, {3, 4}}, at::kHalf, device)) {
    Groups groups;
    groups.emplace_back(g0);
    groups.emplace_back(g1);
    opt = f.make(groups);
    for (int s = 0; s < steps; ++s) step(random_grads(all()));
    set_grads(all(), random_grads(all()));
  }
  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> ps = g0;
    ps.insert(ps.end(), g1.begin(), g1.end());
    return ps;
  }
  void step(const std::vector<at::Tensor>& grads) {
    set_grads(all(), grads);
    opt->step();
  }
  // The first defined state tensor of `p` under `key` ("" = the first one that is not a master).
  at::Tensor* slot(const at::Tensor& p, const std::string& key = "") {
    auto& s = static_cast<FusedParamState&>(*opt->state().at(p.unsafeGetTensorImpl()));
    for (const auto& sl : s.slots())
      if (sl.second->defined() && (key.empty() ? std::string(sl.first) != "master_param" : key == sl.first))
        return sl.second;
    ADD_FAILURE() << "no state '" << key << "'";
    return nullptr;
  }
};

class ApiOptimMisuse : public FamiliesTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiOptimMisuse);

TEST_P(ApiOptimMisuse, AStepRefusedForAnyGroupChangesNoGroup) {
  // Each case spoils group 1 only; before the fix group 0 stepped before group 1's op threw.
  struct Case {
    const char* what;
    std::function<void(TwoGroups&)> spoil;
    std::vector<std::string> needles;
  };
  const c10::Device dev = device();
  const std::vector<Case> cases = {
      {"options", [](TwoGroups& s) { s.opt->param_groups()[1].options().set_lr(-1.0); }, {"param_groups[1]", "-1"}},
      {"grad shape",
       [dev](TwoGroups& s) { s.g1[1].mutable_grad() = torch::zeros({12}, at::TensorOptions(at::kHalf).device(dev)); },
       {"param_groups[1]: params[1].grad has shape [12]", "expected the parameter's [3, 4]"}},
      {"grad layout",
       [dev](TwoGroups& s) {
         s.g1[1].mutable_grad() = torch::zeros({4, 3}, at::TensorOptions(at::kHalf).device(dev)).t();
       },
       {"param_groups[1]: params[1].grad has strides [1, 3]; expected the parameter's layout, strides [4, 1]"}},
      {"state layout",
       [](TwoGroups& s) { *s.slot(s.g1[1]) = s.slot(s.g1[1])->t().contiguous().t(); },
       {"param_groups[1]: params[1] state['", "has strides [1, 3]; expected the parameter's layout"}},
      {"grad dtype",
       [](TwoGroups& s) { s.g1[0].mutable_grad() = s.g1[0].grad().to(at::kDouble); },
       {"param_groups[1]: params[0].grad has dtype", "expected float32, float16 or bfloat16"}},
      {"state dtype",
       [](TwoGroups& s) { *s.slot(s.g1[0]) = s.slot(s.g1[0])->to(at::kDouble); },
       {"param_groups[1]: params[0] state['", "float32"}},
      {"state shape",
       [dev](TwoGroups& s) { *s.slot(s.g1[1]) = torch::zeros({99}, at::TensorOptions().device(dev)); },
       {"param_groups[1]: params[1] state['", "has shape [99]"}},
      {"master dtype",
       [](TwoGroups& s) { *s.slot(s.g1[1], "master_param") = s.slot(s.g1[1], "master_param")->to(at::kHalf); },
       {"param_groups[1]: params[1] state['master_param']", "must be float32"}},
  };
  for_each_family([&](const Family& f) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      TwoGroups s(f, device());
      c.spoil(s);
      const auto before = clone_all(all_state(*s.opt));
      const auto lrs = all_lrs(*s.opt);
      std::vector<std::string> needles = c.needles;
      needles.push_back(s.opt->name());
      expect_c10_error([&] { s.opt->step(); }, needles);
      expect_unchanged(all_state(*s.opt), before, std::string(c.what) + ": state");
      EXPECT_EQ(all_lrs(*s.opt), lrs);
    }
  });
}

TEST_P(ApiOptimMisuse, CheckpointsWithBadStepCountsAreRefusedAndChangeNothing) {
  for_each_family([&](const Family& f) {
    for (const double bad : {kNaN, kInf, -3.0}) {
      TwoGroups source(f, device(), 2);
      source.opt->step_count_tensor(1).fill_(bad);  // the tensor the optimizer holds
      const std::string bytes = save_to_string(*source.opt);
      TwoGroups target(f, device());
      const auto before = clone_all(all_state(*target.opt));
      expect_c10_error([&] { load_from_string(*target.opt, bytes); },
                       {target.opt->name() + ".load", "param_groups[1]['step']", "expected a finite step count >= 0"});
      expect_unchanged(all_state(*target.opt), before, "after a refused load");
    }
  });
}

TEST_P(ApiOptimMisuse, ACloneTrainsBitIdenticallyAndIndependently) {
  for_each_family([&](const Family& f) {
    TwoGroups a(f, device(), 2);
    a.opt->param_groups()[1].options().set_lr(a.opt->param_groups()[1].options().get_lr() * 0.5);
    const std::vector<at::Tensor> params = copies(a.all());
    std::unique_ptr<FusedOptimizer> b = a.opt->clone_base(params);
    EXPECT_EQ(b->name(), a.opt->name());
    EXPECT_EQ(all_lrs(*b), all_lrs(*a.opt));
    EXPECT_EQ(b->step_count(1), 2);
    for (int s = 0; s < 2; ++s) {
      const auto gs = random_grads(params);
      a.step(gs);
      set_grads(params, gs);
      b->step();
    }
    const auto sa = all_state(*a.opt), sb = all_state(*b);
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(sa[i], sb[i])) << "tensor " << i;
      EXPECT_NE(sa[i].data_ptr(), sb[i].data_ptr()) << "tensor " << i << " is shared";
    }
    // Independent: stepping and re-tuning the source leaves the clone as it was.
    const auto frozen = clone_all(all_state(*b));
    const auto lrs = all_lrs(*b);
    a.opt->param_groups()[0].options().set_lr(0.5);
    a.step(random_grads(a.all()));
    expect_unchanged(all_state(*b), frozen, "clone after its source stepped");
    EXPECT_EQ(all_lrs(*b), lrs);
  });
}

TEST_P(ApiOptimMisuse, CloneIsTypedAndRefusesParamsThatDoNotMatch) {
  auto ps = make_params({{6}, {2, 3}}, at::kHalf, device());
  FusedSGD sgd(ps, FusedSGDOptions(0.1).momentum(0.5).master_weights(true));
  set_grads(ps, random_grads(ps));
  sgd.step();
  const auto before = clone_all(all_state(sgd));
  std::unique_ptr<FusedSGD> typed = sgd.clone(copies(ps));  // the family's own type
  EXPECT_EQ(static_cast<const FusedSGDOptions&>(typed->param_groups()[0].options()).momentum(), 0.5);
  const auto opts = at::TensorOptions().device(device());
  expect_c10_error([&] { sgd.clone({ps[0].detach().clone()}); }, {"FusedSGD.clone", "got 1 params; expected 2"});
  expect_c10_error([&] { sgd.clone({ps[0].detach().clone(), torch::zeros({6}, opts.dtype(at::kHalf))}); },
                   {"FusedSGD.clone: params[1] has shape [6]; expected [2, 3]"});
  expect_c10_error([&] { sgd.clone({ps[0].detach().to(at::kFloat), ps[1].detach().clone()}); },
                   {"FusedSGD.clone: params[0] has dtype", "expected Half"});
  expect_c10_error([&] { sgd.clone({at::Tensor(), ps[1].detach().clone()}); }, {"params[0] is undefined"});
  expect_unchanged(all_state(sgd), before, "source of refused clones");
}

}  // namespace
