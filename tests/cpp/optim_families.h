// Every C++ fused optimizer family as a factory over param groups, for the tests that run one
// check across all of them (test_api_optim_misuse.cpp, test_api_optim_layouts.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>

#include <functional>
#include <memory>
#include <vector>

#include "test_support.h"

namespace mixprec::test::api {

using Groups = std::vector<torch::optim::OptimizerParamGroup>;

struct Family {
  const char* op;  // the family's op, for skipping where it has no kernel
  std::function<std::unique_ptr<mixprec::optim::FusedOptimizer>(const Groups&)> make;
};

// Every family with master weights on (so fp16 params carry fp32 masters) and state from step 1.
inline std::vector<Family> families() {
  using namespace mixprec::optim;
  return {
      {"mixprec::sgd_",
       [](const Groups& g) {
         return std::make_unique<FusedSGD>(g, FusedSGDOptions(0.05).momentum(0.9).master_weights(true));
       }},
      {"mixprec::adam_",
       [](const Groups& g) { return std::make_unique<FusedAdam>(g, FusedAdamOptions(1e-3).master_weights(true)); }},
      {"mixprec::adam_",
       [](const Groups& g) { return std::make_unique<FusedAdamW>(g, FusedAdamWOptions(1e-3).master_weights(true)); }},
      {"mixprec::adagrad_",
       [](const Groups& g) {
         return std::make_unique<FusedAdagrad>(g, FusedAdagradOptions(0.05).master_weights(true));
       }},
      {"mixprec::lamb_",
       [](const Groups& g) { return std::make_unique<FusedLAMB>(g, FusedLAMBOptions(0.01).master_weights(true)); }},
      {"mixprec::novograd_",
       [](const Groups& g) {
         return std::make_unique<FusedNovoGrad>(g, FusedNovoGradOptions(0.01).master_weights(true));
       }},
  };
}

inline bool has_kernel(const char* op, c10::DeviceType device) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  return handle &&
         handle->hasKernelForDispatchKey(device == c10::kCUDA ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
}

// A DeviceTest whose for_each_family(check) runs `check` for every family that has a kernel on
// the test's device.
class FamiliesTest : public DeviceTest {
 protected:
  void for_each_family(const std::function<void(const Family&)>& check) {
    for (const Family& f : families()) {
      if (!has_kernel(f.op, GetParam())) continue;
      SCOPED_TRACE(f.op);
      check(f);
    }
  }
};

}  // namespace mixprec::test::api
