// Misuse of the C++ fused optimizers, every family (issue 20): a step refused for any group's
// options, grads or state, or by an op alone (memory shared between its tensors), changes no
// group; checkpoints with bad step counts are refused and change nothing; clone() trains
// bit-identically to its source and independently of it.
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

  TwoGroups(const Family& f, const c10::Device& device, int steps = 1, bool masters = true)
      : g0(make_params({{65537}, {7}}, at::kFloat, device)), g1(make_params({{5}, {3, 4}}, at::kHalf, device)) {
    Groups groups;
    groups.emplace_back(g0);
    groups.emplace_back(g1);
    opt = f.make(groups);
    if (!masters) opt->set_master_weights(false);
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

TEST_P(ApiOptimMisuse, AStepOnlyAnOpRefusesChangesNoGroup) {
  // Memory shared between an op's tensors passes the front's checks; only the op (its overlap
  // check) refuses it. Before the fix group 0 had stepped when group 1's op threw, and on a first
  // step kept the state it made (SGD's momentum buffers, NovoGrad's norms).
  struct Case {
    const char* what;
    int steps;  // before the refused step: 0 = it is the first, its state made by it
    std::function<void(TwoGroups&)> spoil;
    const char* needle;  // after "mixprec::<op>: "
  };
  const std::vector<Case> cases = {
      {"group 1's grad is its param, first step", 0, [](TwoGroups& s) { s.g1[1].mutable_grad() = s.g1[1].detach(); },
       "params[1] shares memory with grads[1]"},
      {"group 1's grad is its param", 2, [](TwoGroups& s) { s.g1[0].mutable_grad() = s.g1[0].detach(); },
       "params[0] shares memory with grads[0]"},
      {"two of group 1's state tensors share memory", 2,
       [](TwoGroups& s) { *s.slot(s.g1[0]) = s.slot(s.g1[1])->view(-1).narrow(0, 2, 5); }, "[1] shares memory with "},
      {"group 0's grad is its param, first step", 0, [](TwoGroups& s) { s.g0[1].mutable_grad() = s.g0[1].detach(); },
       "params[1] shares memory with grads[1]"},
  };
  for_each_family([&](const Family& f) {
    for (const bool masters : {true, false}) {
      for (const Case& c : cases) {
        SCOPED_TRACE(std::string(c.what) + (masters ? ", masters" : ", no masters"));
        TwoGroups s(f, device(), c.steps, masters);
        // A twin of the optimizer as it was, for the step after the refused one.
        const std::vector<at::Tensor> twin_params = copies(s.all());
        const std::unique_ptr<FusedOptimizer> twin = s.opt->clone_base(twin_params);
        const at::Tensor kept = c.steps > 0 ? *s.slot(s.g1[0]) : at::Tensor();  // the state case spoils it
        c.spoil(s);
        const auto before = clone_all(all_state(*s.opt));
        const size_t states = s.opt->state().size();
        bool value_error = false;
        expect_c10_error(
            [&] {
              try {
                s.opt->step();
              } catch (const c10::ValueError&) {
                value_error = true;
                throw;
              }
            },
            {std::string(f.op) + ": ", c.needle, "every tensor the op writes needs memory of its own"});
        EXPECT_TRUE(value_error) << "not a ValueError";
        expect_unchanged(all_state(*s.opt), before, "state");
        EXPECT_EQ(s.opt->state().size(), states);
        // The spoiled state put back, new grads: the next step is the twin's.
        if (kept.defined()) *s.slot(s.g1[0]) = kept;
        const auto grads = random_grads(s.all());
        set_grads(s.all(), grads);
        set_grads(twin_params, grads);
        s.opt->step();
        twin->step();
        const auto a = all_state(*s.opt), b = all_state(*twin);
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "tensor " << i;
      }
    }
  });
}

TEST_P(ApiOptimMisuse, AGradChangedAfterStepsOnTheSameGradsIsCheckedByTheOp) {
  // Steps on unchanged lists and grads skip the check twin (their op took the same tensors); a grad
  // replaced since, here by its param's own memory, must bring it back before group 0 steps.
  for_each_family([&](const Family& f) {
    TwoGroups s(f, device());
    s.opt->step();
    s.opt->step();  // the same grad tensors (zero_grad(set_to_none=false) keeps them)
    s.g1[1].mutable_grad() = s.g1[1].detach();
    const auto before = clone_all(all_state(*s.opt));
    expect_c10_error([&] { s.opt->step(); }, {std::string(f.op) + ": params[1] shares memory with grads[1]"});
    expect_unchanged(all_state(*s.opt), before, "state");
  });
}

TEST_P(ApiOptimMisuse, SGDStepsALateBufferOnlyOnceTheRestIsChecked) {
  // With dampening, a param's first gradient after its group's first step gets an op call of its
  // own (step 1) before the call for the rest; a rest the op refuses must be refused before it.
  if (!has_kernel("mixprec::sgd_", GetParam())) GTEST_SKIP() << "no sgd_ kernel here";
  for (const bool two_groups : {false, true}) {
    for (const bool masters : {true, false}) {
      SCOPED_TRACE(std::string(two_groups ? "in group 1" : "one group") + (masters ? ", masters" : ""));
      const auto g0 = make_params({{5}}, at::kFloat, device());
      const auto ps = make_params({{7}, {3, 4}}, at::kHalf, device());
      Groups groups;
      if (two_groups) groups.emplace_back(g0);
      groups.emplace_back(ps);
      FusedSGD opt(groups, FusedSGDOptions(0.05).momentum(0.9).dampening(0.5).master_weights(masters));
      set_grads(g0, random_grads(g0));
      set_grads(ps, random_grads(ps));
      ps[0].mutable_grad() = at::Tensor();  // its buffer starts at the next step
      opt.step();
      set_grads(g0, random_grads(g0));
      set_grads(ps, random_grads(ps));
      ps[1].mutable_grad() = ps[1].detach();  // the rest's call: [ps[1]]
      const auto before = clone_all(all_state(opt));
      expect_c10_error([&] { opt.step(); },
                       {"mixprec::sgd_: params[0] shares memory with grads[0]; every tensor the op writes"});
      expect_unchanged(all_state(opt), before, "state");
      EXPECT_EQ(opt.state().count(ps[0].unsafeGetTensorImpl()), 0u) << "the late param's state was kept";
    }
  }
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
