// Parameter layouts in the C++ fused optimizers, every family (issue 20): any dense layout
// (channels_last conv weights, permuted dimensions) steps bit for bit like a contiguous copy, with
// masters and state kept in the parameter's layout through steps, checkpoints and clones; layouts
// that skip or repeat memory (expanded, overlapping) are refused before any group steps.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <functional>
#include <memory>

#include "api_support.h"
#include "optim_families.h"
#include "test_support.h"

namespace {

using namespace mixprec::test;
using namespace mixprec::test::api;
using namespace mixprec::optim;

// Group 0: float32, group 1: float16 (with fp32 masters); in each a channels_last conv weight
// straddling the 65536-element chunk and a tensor with permuted dimensions.
struct Layouts {
  std::vector<at::Tensor> dense;   // the strided params
  std::vector<at::Tensor> contig;  // contiguous copies of the same values
  Groups groups(const std::vector<at::Tensor>& ps) const {
    Groups g;
    g.emplace_back(std::vector<at::Tensor>{ps[0], ps[1]});
    g.emplace_back(std::vector<at::Tensor>{ps[2], ps[3]});
    return g;
  }
  explicit Layouts(const c10::Device& device) {
    for (const auto dtype : {at::kFloat, at::kHalf}) {
      dense.push_back(random_tensor({37, 8, 15, 15}, dtype, device).contiguous(at::MemoryFormat::ChannelsLast));
      dense.push_back(random_tensor({3, 5, 4}, dtype, device).permute({2, 0, 1}).contiguous().permute({1, 2, 0}));
    }
    for (auto& p : dense) {
      p.requires_grad_(true);
      contig.push_back(p.detach().contiguous().requires_grad_(true));
    }
  }
};

// Gradients with the same values for both lists, each in its param's layout (as autograd makes them).
void set_same_grads(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor g = random_tensor(a[i].sizes(), a[i].scalar_type(), a[i].device());
    a[i].mutable_grad() = at::empty_like(a[i]).copy_(g);
    b[i].mutable_grad() = at::empty_like(b[i]).copy_(g);
  }
}

// Every state tensor of `p` in `opt`, with its key.
std::vector<std::pair<std::string, at::Tensor>> states_of(FusedOptimizer& opt, const at::Tensor& p) {
  return static_cast<FusedParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).defined_tensors();
}

// Whether the family's op reduces over a tensor (LAMB's trust ratio, NovoGrad's layer norm): its
// sums run in storage order, so another layout rounds them differently.
bool reduces(const Family& f) {
  const std::string op = f.op;
  return op == "mixprec::lamb_" || op == "mixprec::novograd_";
}

// x equals y: bitwise, or for a reducing op as float32 rounding of the sums allows (one float16
// rounding step for float16 tensors).
void expect_same_values(const at::Tensor& x, const at::Tensor& y, bool exact, const std::string& what) {
  if (exact) {
    EXPECT_TRUE(bitwise_equal(x, y)) << what;
  } else {
    EXPECT_EQ(x.scalar_type(), y.scalar_type()) << what;
    EXPECT_LT(rel_err(x, y), x.scalar_type() == at::kFloat ? 1e-5 : 1e-3) << what;
  }
}

// The state of params `a` in `x` equals that of `b` in `y`, and each tensor is laid out as its
// param is.
void expect_same_state(FusedOptimizer& x, const std::vector<at::Tensor>& a, FusedOptimizer& y,
                       const std::vector<at::Tensor>& b, bool exact, const std::string& what) {
  for (size_t i = 0; i < a.size(); ++i) {
    const auto sa = states_of(x, a[i]), sb = states_of(y, b[i]);
    ASSERT_EQ(sa.size(), sb.size()) << what;
    for (size_t k = 0; k < sa.size(); ++k) {
      const std::string w = what + ": param " + std::to_string(i) + " " + sa[k].first;
      expect_same_values(sa[k].second, sb[k].second, exact, w);
      EXPECT_EQ(sa[k].second.strides(), a[i].strides()) << w;
      EXPECT_EQ(sb[k].second.strides(), b[i].strides()) << w;
    }
  }
}

std::vector<at::Tensor> params_of(const FusedOptimizer& opt) {
  std::vector<at::Tensor> ps;
  for (const auto& g : opt.param_groups()) ps.insert(ps.end(), g.params().begin(), g.params().end());
  return ps;
}

class ApiOptimLayouts : public FamiliesTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiOptimLayouts);

TEST_P(ApiOptimLayouts, DenseLayoutsStepBitwiseLikeContiguousCopiesWithStateInTheirLayout) {
  for_each_family([&](const Family& f) {
    const bool exact = !reduces(f);
    Layouts l(device());
    ASSERT_TRUE(l.dense[0].is_contiguous(at::MemoryFormat::ChannelsLast) && !l.dense[0].is_contiguous());
    ASSERT_FALSE(l.dense[1].is_contiguous());
    auto a = f.make(l.groups(l.dense));
    auto b = f.make(l.groups(l.contig));
    for (int step = 0; step < 3; ++step) {
      set_same_grads(l.dense, l.contig);
      a->step();
      b->step();
    }
    for (size_t i = 0; i < l.dense.size(); ++i)
      expect_same_values(l.dense[i].detach(), l.contig[i].detach(), exact, "param " + std::to_string(i));
    ASSERT_GE(states_of(*a, l.dense[2]).size(), 2u) << "float16 params carry a master";
    expect_same_state(*a, l.dense, *b, l.contig, exact, "after steps");

    // A checkpoint loads into the layout of the params it is loaded for, either way.
    const std::string saved = save_to_string(*a);
    Layouts fresh(device());
    auto into_dense = f.make(l.groups(fresh.dense));
    auto into_contig = f.make(l.groups(fresh.contig));
    load_from_string(*into_dense, saved);
    load_from_string(*into_contig, saved);
    expect_same_state(*a, l.dense, *into_dense, fresh.dense, true, "loaded into the same layout");
    expect_same_state(*a, l.dense, *into_contig, fresh.contig, true, "loaded into contiguous params");

    // A clone follows its new params' layout too, and steps like its source.
    std::unique_ptr<FusedOptimizer> c = a->clone_base(copies(l.contig));
    const auto cps = params_of(*c);
    expect_same_state(*a, l.dense, *c, cps, true, "clone");
    set_same_grads(l.dense, cps);
    a->step();
    c->step();
    for (size_t i = 0; i < cps.size(); ++i)
      expect_same_values(l.dense[i].detach(), cps[i].detach(), exact, "clone's param " + std::to_string(i));
  });
}

TEST_P(ApiOptimLayouts, LayoutsThatSkipOrRepeatMemoryAreRefusedBeforeAnyGroupSteps) {
  const auto opts = at::TensorOptions().device(device());
  struct Case {
    const char* what;
    std::function<at::Tensor()> param;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"expanded",
       [&] { return torch::randn({1, 4}, opts).expand({3, 4}).detach(); },
       {"param_groups[1]: params[0] has strides [0, 1] for shape [3, 4], which skip or repeat memory",
        "expected a dense parameter"}},
      {"overlapping",
       [&] { return torch::randn({8}, opts).as_strided({3, 4}, {1, 1}).detach(); },
       {"param_groups[1]: params[0] has strides [1, 1] for shape [3, 4]"}},
      {"gapped",
       [&] { return torch::randn({6, 8}, opts).slice(1, 0, 8, 2).detach(); },
       {"param_groups[1]: params[0] has strides [8, 2] for shape [6, 4]"}},
  };
  for_each_family([&](const Family& f) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      auto good = make_params({{5}, {2, 3}}, at::kFloat, device());
      at::Tensor bad = c.param().requires_grad_(true);
      Groups groups;
      groups.emplace_back(good);
      groups.emplace_back(std::vector<at::Tensor>{bad});
      auto opt = f.make(groups);
      set_grads(good, random_grads(good));
      opt->step();  // state and step counts to protect
      set_grads(good, random_grads(good));
      bad.mutable_grad() = torch::ones({bad.size(0), bad.size(1)}, opts);
      const auto before = clone_all(all_state(*opt));
      const at::Tensor bad_before = bad.detach().clone();
      std::vector<std::string> needles = c.needles;
      needles.push_back(opt->name());
      expect_c10_error([&] { opt->step(); }, needles);
      expect_unchanged(all_state(*opt), before, std::string(c.what) + ": state");
      EXPECT_TRUE(bitwise_equal(bad.detach(), bad_before));
    }
  });
}

TEST_P(ApiOptimLayouts, AGradientOrStateInAnotherLayoutThanItsParamIsRefused) {
  for_each_family([&](const Family& f) {
    Layouts l(device());
    auto opt = f.make(l.groups(l.dense));
    set_same_grads(l.dense, l.contig);
    opt->step();
    // A contiguous gradient for the channels_last param of group 1.
    set_same_grads(l.dense, l.contig);
    l.dense[2].mutable_grad() = l.dense[2].grad().contiguous();
    auto before = clone_all(all_state(*opt));
    expect_c10_error([&] { opt->step(); },
                     {opt->name(), "param_groups[1]: params[0].grad has strides [1800, 225, 15, 1]",
                      "expected the parameter's layout, strides [1800, 1, 120, 8]"});
    expect_unchanged(all_state(*opt), before, "after a refused gradient");
    // The same for a state tensor made contiguous behind the optimizer's back.
    l.dense[2].mutable_grad() = at::empty_like(l.dense[2]).copy_(l.dense[2].grad());
    auto& s = static_cast<FusedParamState&>(*opt->state().at(l.dense[0].unsafeGetTensorImpl()));
    for (const auto& slot : s.slots())
      if (slot.second->defined()) *slot.second = slot.second->contiguous();
    before = clone_all(all_state(*opt));
    expect_c10_error([&] { opt->step(); }, {opt->name(), "param_groups[0]: params[0] state['",
                                            "has strides [1800, 225, 15, 1]; expected the parameter's layout"});
    expect_unchanged(all_state(*opt), before, "after a refused state tensor");
  });
}

}  // namespace
