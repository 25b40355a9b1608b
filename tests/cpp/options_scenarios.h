// Every C++ fused optimizer with every option away from its default, trained on fixed inputs: the
// scenarios behind the checked-in checkpoints of tests/cpp/fixtures (written by
// make_options_fixtures.cpp) and replayed by test_api_optim_options.cpp. Torch and gtest only.
#pragma once

#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mixprec::test::scenarios {

using Groups = std::vector<torch::optim::OptimizerParamGroup>;
using mixprec::optim::FusedOptimizer;

// Values from a fixed integer sequence, so that every build and torch release makes the same bits
// (torch's random generators promise no such thing across releases).
inline at::Tensor fixed_tensor(at::IntArrayRef shape, at::ScalarType dtype, uint64_t seed) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t x = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (auto& e : v) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    e = static_cast<float>(static_cast<int64_t>((x >> 40) % 2001) - 1000) / 700.0f;  // in [-1.43, 1.43]
  }
  return torch::tensor(v).reshape(shape).to(dtype);
}

// Group 0: two float32 params; group 1: two float16 params (fp32 masters where master weights are on).
struct Params {
  std::vector<at::Tensor> g0, g1;
  Params()
      : g0{fixed_tensor({5}, at::kFloat, 1), fixed_tensor({3, 4}, at::kFloat, 2)},
        g1{fixed_tensor({7}, at::kHalf, 3), fixed_tensor({2, 3}, at::kHalf, 4)} {
    for (auto* g : {&g0, &g1})
      for (auto& p : *g) p.requires_grad_(true);
  }
  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> ps = g0;
    ps.insert(ps.end(), g1.begin(), g1.end());
    return ps;
  }
};

// Sets fixed gradients (step `step`) and steps; group 1's second param has no grad on step 1.
inline void fixed_step(FusedOptimizer& opt, const Params& ps, int step) {
  const auto all = ps.all();
  for (size_t i = 0; i < all.size(); ++i) {
    at::Tensor& g = all[i].mutable_grad();
    g = (step == 1 && i == 3) ? at::Tensor() : fixed_tensor(all[i].sizes(), all[i].scalar_type(), 100 * (step + 1) + i);
  }
  opt.step();
}

struct Scenario {
  std::string name;  // also the fixture's file name, <name>.pt
  std::function<std::unique_ptr<FusedOptimizer>(const Params&)> make;
  // The same family and groups with every option at its default (SGD: lr 0): what a checkpoint
  // of `make`'s optimizer loads into.
  std::function<std::unique_ptr<FusedOptimizer>(const Params&)> plain;
};

// Group 0: g0 under the defaults; then g1 as one group of `own[0]`'s options, or with two of
// `own`, each param of g1 in a group of its own: for options that no group may combine (a group
// inherits every option it leaves at its constructor default).
template <class Family, class Options>
Scenario scenario(std::string name, Options defaults, std::vector<Options> own, Options fresh = Options()) {
  const auto build = [](const Params& ps, const Options& d, const std::vector<Options>& o) {
    Groups groups;
    groups.emplace_back(ps.g0);
    if (o.size() == 1) {
      groups.emplace_back(ps.g1, std::make_unique<Options>(o[0]));
    } else {
      for (size_t i = 0; i < ps.g1.size(); ++i)
        groups.emplace_back(std::vector<at::Tensor>{ps.g1[i]}, std::make_unique<Options>(o[i]));
    }
    return std::unique_ptr<FusedOptimizer>(std::make_unique<Family>(groups, d));
  };
  std::vector<Options> fresh_own(own.size(), fresh);
  return {std::move(name), [=](const Params& ps) { return build(ps, defaults, own); },
          [=](const Params& ps) { return build(ps, fresh, fresh_own); }};
}

// Across the two groups every option of every family differs from its constructor default (a
// bool at least once flipped); options no group may combine (Nesterov, dampening) go to groups of
// their own. A group inherits every option it leaves at its constructor default.
inline std::vector<Scenario> all_scenarios() {
  using namespace mixprec::optim;
  return {
      scenario<FusedAdam>("adam",
                          FusedAdamOptions(0.02)
                              .betas({0.8, 0.95})
                              .eps(1e-6)
                              .weight_decay(0.05)
                              .amsgrad(true)
                              .adam_w_mode(false)
                              .master_weights(true),
                          {FusedAdamOptions(0.03)
                               .betas({0.85, 0.99})
                               .eps(1e-7)
                               .weight_decay(0.1)
                               .bias_correction(false)
                               .maximize(true)
                               .master_weights(true)
                               .state_dtype(c10::kBFloat16)}),
      scenario<FusedAdamW>(
          "adamw", FusedAdamWOptions(0.02).betas({0.7, 0.9}).weight_decay(0.2).amsgrad(true).master_weights(true),
          {FusedAdamOptions(0.01).eps(1e-5).bias_correction(false).maximize(true).master_weights(true).state_dtype(
              c10::kBFloat16)},
          FusedAdamOptions(FusedAdamWOptions())),
      scenario<FusedSGD>(
          "sgd", FusedSGDOptions(0.05).momentum(0.9).weight_decay(0.01).master_weights(true),
          {FusedSGDOptions(0.03).momentum(0.7).nesterov(true),
           FusedSGDOptions(0.04).momentum(0.8).dampening(0.1).weight_decay(0.02).wd_after_momentum(true).maximize(
               true)},
          FusedSGDOptions(0.0)),
      scenario<FusedLAMB>("lamb",
                          FusedLAMBOptions(0.02)
                              .betas({0.8, 0.95})
                              .eps(1e-5)
                              .weight_decay(0.03)
                              .bias_correction(false)
                              .max_grad_norm(0.5)
                              .use_nvlamb(true)
                              .master_weights(true),
                          {FusedLAMBOptions(0.03)
                               .betas({0.85, 0.99})
                               .weight_decay(0.0)
                               .grad_averaging(false)
                               .adam_w_mode(false)
                               .max_grad_norm(0.0)
                               .master_weights(true)}),
      scenario<FusedAdagrad>(
          "adagrad",
          FusedAdagradOptions(0.05)
              .eps(1e-8)
              .weight_decay(0.01)
              .lr_decay(0.1)
              .initial_accumulator_value(0.2)
              .master_weights(true),
          {FusedAdagradOptions(0.04).weight_decay(0.02).adagrad_w_mode(true).maximize(true).master_weights(true)}),
      scenario<FusedNovoGrad>("novograd",
                              FusedNovoGradOptions(0.02)
                                  .betas({0.8, 0.95})
                                  .eps(1e-6)
                                  .weight_decay(0.01)
                                  .bias_correction(false)
                                  .reg_inside_moment(true)
                                  .master_weights(true),
                              {FusedNovoGradOptions(0.03)
                                   .betas({0.85, 0.98})
                                   .weight_decay(0.02)
                                   .grad_averaging(false)
                                   .norm_type(0.0)
                                   .init_zero(true)
                                   .master_weights(true)}),
  };
}

}  // namespace mixprec::test::scenarios
