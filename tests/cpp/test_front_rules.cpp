// The rules both fronts apply before an op, as the C++ front applies them: its answers and errors
// must be the library op's (mixprec::fp8_linear_ineligibility, mixprec::master_remainder_check),
// which is what python's Fp8Linear and optimizers ask (tests/python/test_front_rules.py holds the
// Python half, over the same cases and texts).
#include <gtest/gtest.h>
#include <mixprec/fp8.h>
#include <mixprec/ops.h>
#include <mixprec/optim.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "api_support.h"
#include "test_support.h"

namespace {

using namespace mixprec::test;
using mixprec::test::api::load_from_string;
using mixprec::test::api::save_to_string;
namespace fp8 = mixprec::fp8;
using mixprec::optim::FusedAdam;
using mixprec::optim::FusedAdamOptions;

class FrontRules : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(FrontRules);

// The text of the c10::Error fn throws ("" if none), and whether it is of class E.
template <class E> std::pair<std::string, bool> error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return {e.what_without_backtrace(), dynamic_cast<const E*>(&e) != nullptr};
  }
  return {"", false};
}

// Every (out, in, input shape, dtypes) around the boundaries: features 0, 8, 16, 24 and 32, token
// counts 0, 8, 16, 24 and 32 in 1-D, 2-D and 3-D inputs, a mismatched last dimension, non-float dtypes.
TEST_P(FrontRules, Fp8LinearFallsBackExactlyWhereTheOpRefuses) {
  int cases = 0, fell_back = 0;
  for (const int64_t n : {0, 8, 16, 24, 32}) {
    for (const int64_t k : {0, 8, 16, 32}) {
      for (const std::vector<int64_t>& lead : std::vector<std::vector<int64_t>>{{}, {0}, {8}, {16}, {24}, {2, 16}}) {
        for (const int64_t last : {k, k + 16}) {
          for (const auto dtypes : {std::pair{at::kFloat, at::kFloat}, std::pair{at::kBFloat16, at::kBFloat16},
                                    std::pair{at::kDouble, at::kFloat}, std::pair{at::kFloat, at::kDouble}}) {
            std::vector<int64_t> shape = lead;
            shape.push_back(last);
            std::string trace = "n " + std::to_string(n) + " k " + std::to_string(k) + " x";
            for (const int64_t d : shape) trace += " " + std::to_string(d);
            SCOPED_TRACE(trace + " " + c10::toString(dtypes.first) + "/" + c10::toString(dtypes.second));
            const at::Tensor x = random_tensor(shape, dtypes.first, device());
            const at::Tensor w = random_tensor({n, k}, dtypes.second, device(), 0.1);
            const std::string why = mixprec::fp8_linear_ineligibility(w, x);  // python's Fp8Linear asks this
            fp8::ScalingState state({}, device());
            const auto [op_error, op_value_error] = error_of<c10::ValueError>([&] {
              mixprec::fp8_linear(x, w, std::nullopt, state.scale, state.amax, state.amax_history, c10::kFloat8_e4m3fn,
                                  c10::kFloat8_e5m2);
            });
            EXPECT_EQ(why.empty(), op_error.empty()) << "rule: '" << why << "', op: '" << op_error << "'";
            if (last != k || dtypes.first != dtypes.second) continue;  // plain linear raises or upcasts for these
            const at::Tensor before = state.scale.clone();
            const at::Tensor y = fp8::linear(x, w, {}, state);
            EXPECT_EQ(state.fallbacks, why.empty() ? 0 : 1);
            if (!why.empty()) {
              EXPECT_TRUE(bitwise_equal(y, torch::nn::functional::linear(x, w)));
              EXPECT_TRUE(bitwise_equal(state.scale, before));  // a fallback leaves the scaling state alone
            }
            ++cases;
            fell_back += static_cast<int>(state.fallbacks);
          }
        }
      }
    }
  }
  EXPECT_GT(fell_back, 0);
  EXPECT_LT(fell_back, cases);  // both paths taken
}

TEST(FrontRulesFp8, IneligibilityIsTheOpsAnswerInTheSameWords) {
  struct Case {
    int64_t in, out;
    at::ScalarType dtype;
    std::string expected;
  };
  for (const Case& c : std::vector<Case>{{32, 16, at::kFloat, ""},
                                         {20, 16, at::kFloat, "in_features=20 not a multiple of 16"},
                                         {20, 10, at::kFloat, "in_features=20, out_features=10 not a multiple of 16"},
                                         {16, 16, at::kInt,
                                          "weight dtype torch.int32 is not float32, float16 or "
                                          "bfloat16"}}) {
    torch::nn::Linear linear(torch::nn::LinearOptions(c.in, c.out));
    linear->weight.set_requires_grad(false);
    linear->weight.set_data(linear->weight.to(c.dtype));
    const auto why = fp8::ineligibility(*linear);
    EXPECT_EQ(why.value_or(""), c.expected);
    EXPECT_EQ(why.value_or(""), mixprec::fp8_linear_ineligibility(linear->weight));
  }
  const auto why = fp8::ineligibility(*torch::nn::Tanh());
  EXPECT_NE(why.value_or("").find("is not a torch::nn::Linear"), std::string::npos);
}

TEST_P(FrontRules, RemainderRuleAndTextAreTheOpsAndARefusedStepChangesNothing) {
  for (const at::ScalarType bad : {at::kHalf, at::kFloat}) {
    std::vector<at::Tensor> ps;
    for (const auto& [shape, dtype] : std::vector<std::pair<std::vector<int64_t>, at::ScalarType>>{
             {{5}, at::kBFloat16}, {{3, 4}, at::kBFloat16}, {{7}, bad}, {{2}, at::kHalf}})
      ps.push_back(random_tensor(shape, dtype, device()).requires_grad_(true));
    for (const auto& p : ps) p.mutable_grad() = random_tensor(p.sizes(), p.scalar_type(), p.device());
    FusedAdam opt(ps, FusedAdamOptions(1e-3).master_weights(true).master_remainder(true));
    const auto before = clone_all(ps);
    const auto [front, front_value_error] = error_of<c10::ValueError>([&] { opt.step(); });
    const auto [rule, rule_value_error] = error_of<c10::ValueError>([&] {
      mixprec::master_remainder_check(ps, "mixprec::optim::FusedAdam", "master_remainder",
                                      "param_groups[0]: params[{}]");
    });
    EXPECT_TRUE(front_value_error && rule_value_error);
    EXPECT_EQ(front, rule);
    const std::string expected =
        "mixprec::optim::FusedAdam: master_remainder needs bfloat16 params; "
        "param_groups[0]: params[2] is " +
        std::string(bad == at::kHalf ? "torch.float16" : "torch.float32") + " (";
    EXPECT_EQ(front.substr(0, expected.size()), expected);
    expect_unchanged(ps, before, "params");
    EXPECT_TRUE(opt.state().empty());
  }
}

TEST_P(FrontRules, LoadedRemainderForANonBf16ParamIsTheOpsTypeErrorAndChangesNothing) {
  std::vector<at::Tensor> src = {random_tensor({6}, at::kBFloat16, device()).requires_grad_(true),
                                 random_tensor({2, 3}, at::kBFloat16, device()).requires_grad_(true)};
  FusedAdam source(src, FusedAdamOptions(1e-3).master_weights(true).master_remainder(true));
  for (const auto& p : src) p.mutable_grad() = random_tensor(p.sizes(), p.scalar_type(), p.device());
  source.step();
  // The same shapes, param 1 float16 under fp32 masters: the checkpoint's remainder cannot fit it.
  std::vector<at::Tensor> dst = {random_tensor({6}, at::kBFloat16, device()).requires_grad_(true),
                                 random_tensor({2, 3}, at::kHalf, device()).requires_grad_(true)};
  FusedAdam target(dst, FusedAdamOptions(1e-3).master_weights(true));
  for (const auto& p : dst) p.mutable_grad() = random_tensor(p.sizes(), p.scalar_type(), p.device());
  target.step();
  const auto params_before = clone_all(dst);
  const auto state_before = clone_all(mixprec::test::api::all_state(target));
  const std::string saved = save_to_string(source);
  const auto [front, front_type_error] = error_of<c10::TypeError>([&] { load_from_string(target, saved); });
  EXPECT_TRUE(front_type_error) << front;
  const std::string tail = " is an int16 remainder, which needs a bfloat16 parameter; the parameter is torch.float16";
  ASSERT_GE(front.size(), tail.size()) << front;
  EXPECT_EQ(front.substr(front.size() - tail.size()), tail);
  // The op's own words for that slot, as python's load_state_dict asks it.
  const std::string where = front.substr(0, front.size() - tail.size());
  const auto [rule, rule_type_error] =
      error_of<c10::TypeError>([&] { mixprec::master_remainder_check({dst[1]}, "", "master_remainder", where, true); });
  EXPECT_TRUE(rule_type_error);
  EXPECT_EQ(front, rule);
  expect_unchanged(dst, params_before, "params");
  expect_unchanged(mixprec::test::api::all_state(target), state_before, "state");
}

}  // namespace
