// The options classes of the C++ fused optimizers: every hyper-parameter of an op family's list
// (mixprec/optim_args.h) is an option with the list's default, reaches the op's Args, the
// checkpoint under its own name and group inheritance; betas map onto beta1/beta2 as one value;
// checkpoints written before the classes were generated (tests/cpp/fixtures) still load.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <sstream>
#include <string>

#include "options_scenarios.h"
#include "test_support.h"

namespace {

using namespace mixprec::test;
using namespace mixprec::test::scenarios;
using namespace mixprec::optim;

// A value other than `d`, of its type.
double other(double d) { return d == 0 ? 0.375 : d * 1.5; }
bool other(bool d) { return !d; }
int64_t other(int64_t d) { return d + 7; }

template <class Options> torch::serialize::InputArchive archived(const Options& o) {
  torch::serialize::OutputArchive out;
  o.serialize(out);
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  return in;
}

// For one field of a family's list: the options' default is the list's; the setter chains and
// the getter, args(), a checkpoint (under the field's name) and group inheritance all see it.
#define CHECK_LIST_FIELD(type, name, default_value)                                            \
  {                                                                                            \
    SCOPED_TRACE(#name);                                                                       \
    const type v = other(static_cast<type>(default_value));                                    \
    EXPECT_EQ(fresh.name(), static_cast<type>(default_value));                                 \
    EXPECT_EQ(Options(fresh).name(v).args().name, v);                                          \
    Options set = fresh;                                                                       \
    set.name(v);                                                                               \
    auto in = archived(set);                                                                   \
    c10::IValue stored;                                                                        \
    EXPECT_TRUE(in.try_read(#name, stored)) << "no checkpoint key '" #name "'";                \
    Options loaded = fresh;                                                                    \
    loaded.serialize(in);                                                                      \
    EXPECT_EQ(loaded.name(), v);                                                               \
    Options inherits = fresh;                                                                  \
    inherits.inherit_unset(set, fresh);                                                        \
    EXPECT_EQ(inherits.name(), v) << "a group leaving it unset takes the optimizer's default"; \
    Options keeps = set;                                                                       \
    keeps.inherit_unset(fresh, fresh);                                                         \
    EXPECT_EQ(keeps.name(), v) << "a group's own value stays";                                 \
  }

TEST(ApiOptimOptions, EveryHyperParameterOfAnOpIsAnOptionThatReachesTheOp) {
  {
    using Options = FusedAdamOptions;
    const Options fresh;
    MIXPREC_ADAM_ARGS(CHECK_LIST_FIELD)
  }
  {
    using Options = FusedSGDOptions;
    const Options fresh(0.1);
    MIXPREC_SGD_ARGS(CHECK_LIST_FIELD)
  }
  {
    using Options = FusedLAMBOptions;
    const Options fresh;
    MIXPREC_LAMB_ARGS(CHECK_LIST_FIELD)
  }
  {
    using Options = FusedAdagradOptions;
    const Options fresh;
    MIXPREC_ADAGRAD_ARGS(CHECK_LIST_FIELD)
  }
  {
    using Options = FusedNovoGradOptions;
    const Options fresh;
    MIXPREC_NOVOGRAD_ARGS(CHECK_LIST_FIELD)
  }
}

TEST(ApiOptimOptions, BetasAreBeta1AndBeta2AndInheritAsOneValue) {
  FusedLAMBOptions o = FusedLAMBOptions(1e-3).betas({0.7, 0.8});
  EXPECT_EQ(o.beta1(), 0.7);
  EXPECT_EQ(o.beta2(), 0.8);
  EXPECT_EQ(o.args().beta1, 0.7);
  EXPECT_EQ(o.args().beta2, 0.8);
  o.beta2(0.85);
  EXPECT_EQ(o.betas(), std::make_tuple(0.7, 0.85));
  // torch::optim's rule for its tuple field: betas given with beta1 at its default are the
  // group's own, both of them; unset betas come from the defaults, both of them.
  const FusedAdamOptions fresh, defaults = FusedAdamOptions().betas({0.8, 0.95});
  FusedAdamOptions own = FusedAdamOptions().betas({0.9, 0.99});
  own.inherit_unset(defaults, fresh);
  EXPECT_EQ(own.betas(), std::make_tuple(0.9, 0.99));
  FusedAdamOptions unset;
  unset.inherit_unset(defaults, fresh);
  EXPECT_EQ(unset.betas(), std::make_tuple(0.8, 0.95));
  // SGD's lr has no default (torch::optim::SGDOptions): never inherited, whatever its value.
  FusedSGDOptions sgd(0.0);
  sgd.inherit_unset(FusedSGDOptions(0.5).momentum(0.9), FusedSGDOptions(0.0));
  EXPECT_EQ(sgd.lr(), 0.0);
  EXPECT_EQ(sgd.momentum(), 0.9);
}

TEST(ApiOptimOptions, AnArchiveThatFailsToReadChangesNothing) {
  const FusedAdamOptions before = FusedAdamOptions(0.02).betas({0.8, 0.95}).eps(1e-6).amsgrad(true);
  // SGD's archive has lr, weight_decay, maximize and master_weights but no betas.
  FusedAdamOptions o = before;
  auto sgd = archived(FusedSGDOptions(0.5).weight_decay(0.25).maximize(true).master_weights(true));
  expect_c10_error([&] { o.serialize(sgd); }, {"FusedAdamOptions: the checkpoint has no 'beta1'"});
  EXPECT_EQ(o.lr(), 0.02);  // before, the fields read ahead of the missing one were written
  EXPECT_EQ(o.weight_decay(), 0.0);
  EXPECT_FALSE(o.maximize());
  EXPECT_FALSE(o.master_weights());
  EXPECT_EQ(o.betas(), std::make_tuple(0.8, 0.95));
  EXPECT_TRUE(o.amsgrad());

  // A state_dtype code that is no dtype at all, and one that FusedAdam does not keep.
  for (const int64_t code : {int64_t{999}, static_cast<int64_t>(c10::kDouble)}) {
    torch::serialize::OutputArchive out;
    for (const char* key : {"lr", "beta1", "beta2", "eps", "weight_decay"}) out.write(key, c10::IValue(0.5));
    for (const char* key : {"adam_w_mode", "bias_correction", "maximize", "amsgrad", "master_weights"})
      out.write(key, c10::IValue(true));
    out.write("state_dtype", c10::IValue(code));
    std::stringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    FusedAdamOptions target = before;
    if (code == 999) {
      expect_c10_error([&] { target.serialize(in); }, {"'state_dtype' must be a dtype code, got 999"});
      EXPECT_EQ(target.lr(), 0.02);
      EXPECT_EQ(target.eps(), 1e-6);
    } else {
      target.serialize(in);  // read as it is; the family's range check refuses it
      expect_c10_error([&] { target.check("where"); }, {"where: state_dtype must be float32, bfloat16 or int8"});
    }
  }
}

// ---- what a group names ------------------------------------------------------------------------
// The Python front's rule (tests/conformance: the C++ front used to inherit a field a group named
// at the class's default): a group keeps every field it named, whatever the value.
TEST(ApiOptimOptions, AGroupKeepsWhatItNamesEvenAtTheClassDefault) {
  const auto p = [] { return std::vector<at::Tensor>{torch::randn({3}).requires_grad_(true)}; };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(p(), std::make_unique<FusedAdamOptions>(
                               FusedAdamOptions().master_weights(false).weight_decay(0.0).betas({0.9, 0.999})));
  groups.emplace_back(p(), std::make_unique<FusedAdamOptions>(FusedAdamOptions()));  // names nothing
  groups.emplace_back(p(), std::make_unique<FusedAdamOptions>(FusedAdamOptions(1e-3)));
  FusedAdam opt(groups, FusedAdamOptions(0.02).master_weights(true).weight_decay(0.05).betas({0.8, 0.95}));
  const auto& named = static_cast<const FusedAdamOptions&>(opt.param_groups()[0].options());
  EXPECT_FALSE(named.master_weights());
  EXPECT_EQ(named.weight_decay(), 0.0);
  EXPECT_EQ(named.betas(), std::make_tuple(0.9, 0.999));
  EXPECT_EQ(named.lr(), 0.02) << "lr equal to the constructor's default is inherited (every constructor sets it)";
  const auto& unnamed = static_cast<const FusedAdamOptions&>(opt.param_groups()[1].options());
  EXPECT_TRUE(unnamed.master_weights());
  EXPECT_EQ(unnamed.weight_decay(), 0.05);
  EXPECT_EQ(unnamed.betas(), std::make_tuple(0.8, 0.95));
  EXPECT_EQ(static_cast<const FusedAdamOptions&>(opt.param_groups()[2].options()).lr(), 0.02);
  // FusedAdamWOptions' own defaults (weight_decay 1e-2) are not a group's choice: still inherited.
  FusedAdamW w(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                   p(), std::make_unique<FusedAdamWOptions>(FusedAdamWOptions()))},
               FusedAdamWOptions().weight_decay(0.3));
  EXPECT_EQ(static_cast<const FusedAdamOptions&>(w.param_groups()[0].options()).weight_decay(), 0.3);
}

TEST(ApiOptimOptions, SetFieldSetsAnyListedOptionByNameAndRefusesTheRestUnchanged) {
  FusedLAMBOptions o;
  o.set_field("max_grad_norm", c10::IValue(int64_t{2})).set_field("use_nvlamb", c10::IValue(true));
  o.set_field("betas", c10::ivalue::Tuple::create({c10::IValue(0.5), c10::IValue(0.6)}));
  EXPECT_EQ(o.max_grad_norm(), 2.0);
  EXPECT_TRUE(o.use_nvlamb());
  EXPECT_EQ(o.betas(), std::make_tuple(0.5, 0.6));
  FusedAdamOptions a;
  a.set_field("state_dtype", c10::IValue(static_cast<int64_t>(c10::kBFloat16)));
  EXPECT_EQ(a.state_dtype(), c10::kBFloat16);
  // Named: a group setting a field to its class default keeps it.
  FusedLAMBOptions g;
  g.set_field("weight_decay", c10::IValue(0.01));  // LAMB's own default
  g.inherit_unset(FusedLAMBOptions().weight_decay(0.2), FusedLAMBOptions());
  EXPECT_EQ(g.weight_decay(), 0.01);

  const FusedLAMBOptions before = o;
  expect_c10_error([&] { o.set_field("bogus", c10::IValue(1.0)); },
                   {"FusedLAMBOptions.set_field: FusedLAMBOptions has no option 'bogus'"});
  expect_c10_error([&] { o.set_field("eps", c10::IValue(std::string("small"))); },
                   {"FusedLAMBOptions.set_field: 'eps' must be a number, got String"});
  expect_c10_error([&] { o.set_field("use_nvlamb", c10::IValue(1.0)); }, {"'use_nvlamb' must be a bool"});
  expect_c10_error([&] { o.set_field("betas", c10::IValue(0.5)); }, {"'betas' must be a tuple of two numbers"});
  expect_c10_error([&] { a.set_field("state_dtype", c10::IValue(int64_t{999})); },
                   {"'state_dtype' must be a dtype code, got 999"});
  EXPECT_EQ(a.state_dtype(), c10::kBFloat16);
  EXPECT_TRUE(o.same_but_lr(before));
  EXPECT_EQ(o.eps(), before.eps());
}

// ---- checkpoints of earlier builds ------------------------------------------------------------
#define EXPECT_SAME_FIELD(field) EXPECT_EQ(a->field(), b.field()) << #field

// Every option of x and y, written out per family (independent of the lists the classes use).
void expect_same_options(const torch::optim::OptimizerOptions& x, const torch::optim::OptimizerOptions& y) {
  EXPECT_EQ(x.get_lr(), y.get_lr());
  const auto& fx = dynamic_cast<const FusedOptions&>(x);
  const auto& fy = dynamic_cast<const FusedOptions&>(y);
  EXPECT_EQ(fx.uses_master_weights(), fy.uses_master_weights());
  if (const auto* a = dynamic_cast<const FusedAdamOptions*>(&x)) {
    const auto& b = dynamic_cast<const FusedAdamOptions&>(y);
    EXPECT_SAME_FIELD(betas);
    EXPECT_SAME_FIELD(eps);
    EXPECT_SAME_FIELD(weight_decay);
    EXPECT_SAME_FIELD(amsgrad);
    EXPECT_SAME_FIELD(adam_w_mode);
    EXPECT_SAME_FIELD(bias_correction);
    EXPECT_SAME_FIELD(maximize);
    EXPECT_SAME_FIELD(state_dtype);
  } else if (const auto* a = dynamic_cast<const FusedSGDOptions*>(&x)) {
    const auto& b = dynamic_cast<const FusedSGDOptions&>(y);
    EXPECT_SAME_FIELD(momentum);
    EXPECT_SAME_FIELD(dampening);
    EXPECT_SAME_FIELD(weight_decay);
    EXPECT_SAME_FIELD(nesterov);
    EXPECT_SAME_FIELD(wd_after_momentum);
    EXPECT_SAME_FIELD(maximize);
  } else if (const auto* a = dynamic_cast<const FusedLAMBOptions*>(&x)) {
    const auto& b = dynamic_cast<const FusedLAMBOptions&>(y);
    EXPECT_SAME_FIELD(betas);
    EXPECT_SAME_FIELD(eps);
    EXPECT_SAME_FIELD(weight_decay);
    EXPECT_SAME_FIELD(bias_correction);
    EXPECT_SAME_FIELD(grad_averaging);
    EXPECT_SAME_FIELD(adam_w_mode);
    EXPECT_SAME_FIELD(max_grad_norm);
    EXPECT_SAME_FIELD(use_nvlamb);
  } else if (const auto* a = dynamic_cast<const FusedAdagradOptions*>(&x)) {
    const auto& b = dynamic_cast<const FusedAdagradOptions&>(y);
    EXPECT_SAME_FIELD(eps);
    EXPECT_SAME_FIELD(weight_decay);
    EXPECT_SAME_FIELD(adagrad_w_mode);
    EXPECT_SAME_FIELD(lr_decay);
    EXPECT_SAME_FIELD(initial_accumulator_value);
    EXPECT_SAME_FIELD(maximize);
  } else if (const auto* a = dynamic_cast<const FusedNovoGradOptions*>(&x)) {
    const auto& b = dynamic_cast<const FusedNovoGradOptions&>(y);
    EXPECT_SAME_FIELD(betas);
    EXPECT_SAME_FIELD(eps);
    EXPECT_SAME_FIELD(weight_decay);
    EXPECT_SAME_FIELD(bias_correction);
    EXPECT_SAME_FIELD(grad_averaging);
    EXPECT_SAME_FIELD(reg_inside_moment);
    EXPECT_SAME_FIELD(norm_type);
    EXPECT_SAME_FIELD(init_zero);
  } else {
    ADD_FAILURE() << "options of an unknown family";
  }
}

// Step counts, NovoGrad's group moments and every param's state tensors, in order.
std::vector<at::Tensor> optimizer_state(FusedOptimizer& opt) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < opt.param_groups().size(); ++i) {
    out.push_back(opt.step_count_tensor(i));
    if (auto* n = dynamic_cast<FusedNovoGrad*>(&opt)) out.push_back(n->exp_avg_sq(i));
    for (const auto& p : opt.param_groups()[i].params())
      for (const auto& kv : static_cast<FusedParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).defined_tensors())
        out.push_back(kv.second);
  }
  return out;
}

TEST(ApiOptimOptions, CheckpointsOfEarlierBuildsLoadAndTrainOnBitIdentically) {
  for (const Scenario& s : all_scenarios()) {
    SCOPED_TRACE(s.name);
    const Params ps, qs;
    auto replayed = s.make(ps);
    fixed_step(*replayed, ps, 0);
    fixed_step(*replayed, ps, 1);
    auto loaded = s.plain(qs);
    torch::serialize::InputArchive in;
    in.load_from(std::string(MIXPREC_TEST_FIXTURES) + "/" + s.name + ".pt");
    loaded->load(in);
    ASSERT_EQ(loaded->param_groups().size(), replayed->param_groups().size());
    for (size_t g = 0; g < loaded->param_groups().size(); ++g) {
      SCOPED_TRACE("group " + std::to_string(g));
      expect_same_options(replayed->param_groups()[g].options(), loaded->param_groups()[g].options());
      EXPECT_EQ(loaded->step_count(g), g == 2 ? 1 : 2);  // SGD's third group had no grad on step 1
    }
    // The model's weights travel in a checkpoint of their own (the fp16 params' fp32 masters are
    // in the optimizer's).
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < ps.all().size(); ++i) qs.all()[i].copy_(ps.all()[i]);
    }
    for (int step = 2; step < 4; ++step) {
      const auto a = optimizer_state(*replayed), b = optimizer_state(*loaded);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "state " << i << " before step " << step;
      fixed_step(*replayed, ps, step);
      fixed_step(*loaded, qs, step);
      const auto pa = ps.all(), pb = qs.all();
      for (size_t i = 0; i < pa.size(); ++i)
        EXPECT_TRUE(bitwise_equal(pa[i], pb[i])) << "param " << i << " after step " << step;
    }
  }
}

}  // namespace
