// master_weights changed between steps of the C++ fused optimizers (issues 20/21, as the Python
// front's _master_sync): stale masters dropped, missing ones made from the params, a refused step
// taking back what it made.
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

FusedParamState& state(FusedOptimizer& opt, const at::Tensor& p) {
  return static_cast<FusedParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

// Turns master weights on or off as a user can: for the whole optimizer, or in one group's options.
void switch_masters(FusedOptimizer& opt, bool on, int group) {
  if (group < 0) {
    opt.set_master_weights(on);
  } else {
    dynamic_cast<FusedOptions&>(opt.param_groups()[group].options()).set_master_weights(on);
  }
}

// The reference: a deep copy of `opt` over copies of its params, in which the params of group
// `remade` (every group: -1) that have state get masters made by hand from the params (fp32
// copies, or zero remainders) where their group keeps masters.
struct Twin {
  std::vector<at::Tensor> params;
  std::unique_ptr<FusedOptimizer> opt;

  Twin(FusedOptimizer& source, const std::vector<at::Tensor>& source_params, bool remainder, int remade = -1)
      : params(copies(source_params)), opt(source.clone_base(params)) {
    size_t k = 0;
    for (size_t i = 0; i < opt->param_groups().size(); ++i) {
      const auto& g = opt->param_groups()[i];
      const bool masters = dynamic_cast<const FusedOptions&>(g.options()).uses_master_weights();
      for (size_t j = 0; j < g.params().size(); ++j, ++k) {
        const at::Tensor& p = params[k];
        if (!masters || (remade >= 0 && static_cast<int>(i) != remade) || !opt->state().count(p.unsafeGetTensorImpl()))
          continue;
        state(*opt, p).master_param(remainder ? at::zeros_like(p, at::kShort) : p.detach().to(at::kFloat));
      }
    }
  }
};

void expect_same(FusedOptimizer& a, FusedOptimizer& b, const std::string& what) {
  const auto sa = all_state(a), sb = all_state(b);
  ASSERT_EQ(sa.size(), sb.size()) << what;
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(bitwise_equal(sa[i], sb[i])) << what << ": tensor " << i;
}

bool any_master(FusedOptimizer& opt, const std::vector<at::Tensor>& ps) {
  for (const auto& p : ps)
    if (opt.state().count(p.unsafeGetTensorImpl()) && state(opt, p).master_param().defined()) return true;
  return false;
}

// Group 0: bf16 params (one past a 64 Ki CPU chunk); group 1: fp16 params (bf16 for remainders,
// which need bf16).
struct SwitchGroups {
  std::vector<at::Tensor> g0, g1;
  std::unique_ptr<FusedOptimizer> opt;

  SwitchGroups(const std::function<std::unique_ptr<FusedOptimizer>(const Groups&)>& make, const c10::Device& dev,
               bool remainder)
      : g0(make_params({{65537}, {3, 5}}, at::kBFloat16, dev)),
        g1(make_params({{7}, {2, 3}}, remainder ? at::kBFloat16 : at::kHalf, dev)) {
    Groups groups;
    groups.emplace_back(g0);
    groups.emplace_back(g1);
    opt = make(groups);
  }
  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> ps = g0;
    ps.insert(ps.end(), g1.begin(), g1.end());
    return ps;
  }
  void step() {
    set_grads(all(), random_grads(all()));
    opt->step();
  }
};

// on, step, off (all groups or group 0), two steps, on: the next step must start from the weights
// the off-steps left, as a twin given masters made from those weights does. Before the fix the
// old masters were kept and brought back the weights of before the off-steps.
void check_switch(const std::function<std::unique_ptr<FusedOptimizer>(const Groups&)>& make, const c10::Device& dev,
                  bool remainder) {
  for (const int group : {-1, 0}) {
    SCOPED_TRACE(group < 0 ? "set_master_weights" : "group 0's options");
    SwitchGroups s(make, dev, remainder);
    s.step();
    switch_masters(*s.opt, false, group);
    s.step();
    EXPECT_FALSE(any_master(*s.opt, s.g0)) << "masters kept after a step without them";
    EXPECT_EQ(any_master(*s.opt, s.g1), group >= 0) << "group 1's masters";
    s.step();
    switch_masters(*s.opt, true, group);
    Twin twin(*s.opt, s.all(), remainder, group);  // group 1 keeps its own masters when only 0 switched
    for (int k = 0; k < 2; ++k) {
      const auto grads = random_grads(s.all());
      set_grads(s.all(), grads);
      set_grads(twin.params, grads);
      s.opt->step();
      twin.opt->step();
      expect_same(*s.opt, *twin.opt, "step " + std::to_string(k) + " after masters came back");
    }
    EXPECT_TRUE(any_master(*s.opt, s.g0));
    EXPECT_EQ(state(*s.opt, s.g0[0]).master_param().scalar_type(), remainder ? at::kShort : at::kFloat);
  }
}

class ApiOptimMasterSwitch : public FamiliesTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiOptimMasterSwitch);

TEST_P(ApiOptimMasterSwitch, MastersSwitchedOffAndOnContinueFromTheParams) {
  for_each_family([&](const Family& f) { check_switch(f.make, device(), /*remainder=*/false); });
}

TEST_P(ApiOptimMasterSwitch, RemaindersSwitchedOffAndOnContinueFromTheParams) {
  check_switch(
      [](const Groups& g) {
        return std::make_unique<FusedSGD>(
            g, FusedSGDOptions(0.05).momentum(0.9).master_weights(true).master_remainder(true));
      },
      device(), /*remainder=*/true);
  check_switch(
      [](const Groups& g) {
        return std::make_unique<FusedAdam>(g, FusedAdamOptions(1e-2).master_weights(true).master_remainder(true));
      },
      device(), /*remainder=*/true);
}

TEST_P(ApiOptimMasterSwitch, AParamCastToBf16AfterStepsGetsAMasterFromIt) {
  // model.to(bf16) after fp32 steps with master_weights on: as at a first step (the Python front
  // now does the same).
  for_each_family([&](const Family& f) {
    auto ps = make_params({{65537}, {4, 3}}, at::kFloat, device());
    Groups groups;
    groups.emplace_back(ps);
    auto opt = f.make(groups);
    set_grads(ps, random_grads(ps));
    opt->step();
    EXPECT_FALSE(any_master(*opt, ps));  // fp32 params are their own masters
    for (auto& p : ps) p.set_data(p.detach().to(at::kBFloat16));
    Twin twin(*opt, ps, /*remainder=*/false);
    const auto grads = random_grads(ps);
    set_grads(ps, grads);
    set_grads(twin.params, grads);
    opt->step();
    twin.opt->step();
    ASSERT_TRUE(any_master(*opt, ps));
    EXPECT_EQ(state(*opt, ps[0]).master_param().scalar_type(), at::kFloat);
    expect_same(*opt, *twin.opt, "after the cast");
  });
}

TEST_P(ApiOptimMasterSwitch, ARefusedStepTakesBackTheMastersAndStateItMade) {
  // The op refuses a grad sharing its param's memory (overlap), after the lists were built: what
  // building them made (state, masters, step counts) must go again, in the first group too.
  for_each_family([&](const Family& f) {
    for (const bool first_step : {true, false}) {
      SCOPED_TRACE(first_step ? "first step" : "masters switched back on");
      SwitchGroups s(f.make, device(), /*remainder=*/false);
      if (!first_step) {
        s.step();
        s.opt->set_master_weights(false);
        s.step();
        s.opt->set_master_weights(true);
      }
      set_grads(s.all(), random_grads(s.all()));
      const at::Tensor good = s.g0[1].grad();
      s.g0[1].mutable_grad() = s.g0[1].detach();  // same dtype, shape and layout: only the op sees it
      const auto before = clone_all(all_state(*s.opt));
      const size_t states = s.opt->state().size();
      expect_c10_error([&] { s.opt->step(); }, {"shares memory with", "no grad that is its param"});
      expect_unchanged(all_state(*s.opt), before, "after the refused step");
      EXPECT_EQ(s.opt->state().size(), states);
      EXPECT_FALSE(any_master(*s.opt, s.all()));
      // Then a good step runs as a twin's from the same point, masters made from the params.
      s.g0[1].mutable_grad() = good;
      Twin twin(*s.opt, s.all(), /*remainder=*/false);
      set_grads(twin.params, [&] {
        std::vector<at::Tensor> gs;
        for (const auto& p : s.all()) gs.push_back(p.grad());
        return gs;
      }());
      s.opt->step();
      twin.opt->step();
      expect_same(*s.opt, *twin.opt, "the step after the refused one");
    }
  });
}

}  // namespace
