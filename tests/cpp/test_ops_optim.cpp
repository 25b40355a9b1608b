// The typed C++ optimizer calls of mixprec/ops.h, which push each family's Args by its declared
// field list and call the op boxed: every field reaches the kernel (against float64 references),
// and the validate-only twin refuses what the step refuses, with the same message, touching nothing.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "test_support.h"

namespace {

using namespace mixprec::test;

std::vector<at::Tensor> randoms(const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> out;
  for (int64_t n : sizes) out.push_back(random_tensor({n}, at::kFloat, torch::kCPU));
  return out;
}

// torch.optim.SGD's step in float64 on copies, with Apex's wd_after_momentum and maximize.
void sgd_reference(std::vector<at::Tensor>& w, const std::vector<at::Tensor>& g, std::vector<at::Tensor>& buf,
                   const mixprec::SgdArgs& a, double lr, bool first) {
  for (size_t i = 0; i < w.size(); ++i) {
    at::Tensor d = a.maximize ? -g[i] : g[i].clone();
    if (!a.wd_after_momentum) d = d + a.weight_decay * w[i];
    buf[i] = first ? d.clone() : buf[i] * a.momentum + (1 - a.dampening) * d;
    d = a.nesterov ? d + a.momentum * buf[i] : buf[i];
    if (a.wd_after_momentum) d = d + a.weight_decay * w[i];
    w[i] = w[i] - lr * d;
  }
}

std::vector<at::Tensor> to64(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.to(at::kDouble));
  return out;
}

// Each non-default field of SgdArgs, set one at a time, changes the result as the reference says.
TEST(OpsOptim, TypedSgdCallPassesEveryDeclaredField) {
  seed_current_test();
  auto rng = host_rng();
  const std::vector<int64_t> sizes = boundary_sizes(rng);
  std::vector<mixprec::SgdArgs> variants(5);
  for (auto& a : variants) a.momentum = 0.9;
  variants[1].dampening = 0.25;
  variants[2].weight_decay = 0.1;
  variants[2].wd_after_momentum = true;
  variants[3].nesterov = true;
  variants[4].maximize = true;
  variants[4].weight_decay = 0.05;
  for (const mixprec::SgdArgs& a : variants) {
    auto params = randoms(sizes), grads = randoms(sizes), bufs = randoms(sizes);
    auto w64 = to64(params), b64 = to64(bufs);
    const auto g64 = to64(grads);
    mixprec::StepArgs s;
    s.lr = 0.05;
    s.step = 2;
    mixprec::sgd_(params, grads, bufs, {}, a, s);
    sgd_reference(w64, g64, b64, a, s.lr, /*first=*/false);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LE(rel_err(params[i], w64[i]), 1e-5) << "param " << i;
      EXPECT_LE(rel_err(bufs[i], b64[i]), 1e-5) << "buffer " << i;
    }
  }
}

// The step scalars: step_tensor counts the step, found_inf skips it whole.
TEST(OpsOptim, TypedAdamCallTakesStepScalars) {
  seed_current_test();
  auto params = randoms({5, 33}), grads = randoms({5, 33});
  std::vector<at::Tensor> m, v;
  for (const auto& p : params) {
    m.push_back(torch::zeros_like(p));
    v.push_back(torch::zeros_like(p));
  }
  mixprec::StepArgs s;
  s.step_tensor = torch::zeros({1});
  s.found_inf = torch::ones({1});
  const auto before = clone_all(params);
  mixprec::adam_(params, grads, m, v, {}, {}, mixprec::AdamArgs{}, s);
  EXPECT_EQ(s.step_tensor->item<float>(), 0.f);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], before[i]));
  s.found_inf->zero_();
  mixprec::adam_(params, grads, m, v, {}, {}, mixprec::AdamArgs{}, s);
  EXPECT_EQ(s.step_tensor->item<float>(), 1.f);
  // First Adam step with bias correction: w - lr * sign(g) (up to eps).
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_LE(rel_err(params[i], before[i].to(at::kDouble) - s.lr * grads[i].sign().to(at::kDouble)), 1e-5);
}

std::string refusal(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// adam_check: the step's own message for an aliased state tensor and for a range error; neither
// call writes anything.
TEST(OpsOptim, CheckTwinRefusesWhatTheStepRefuses) {
  seed_current_test();
  auto params = randoms({8, 8}), grads = randoms({8, 8}), m = randoms({8, 8});
  auto v = clone_all(m);
  for (auto& t : v) t.abs_();
  m[1] = v[0];  // one tensor as exp_avgs[1] and exp_avg_sqs[0]
  mixprec::StepArgs s;
  s.step = 1;
  mixprec::StepArgs check = s;
  check.validate_only = true;  // adam_check
  for (const double beta2 : {0.999, 1.0}) {
    mixprec::AdamArgs a;
    a.beta2 = beta2;
    const auto before = clone_all(params), v_before = clone_all(v);
    const std::string checked = refusal([&] { mixprec::adam_(params, grads, m, v, {}, {}, a, check); });
    const std::string stepped = refusal([&] { mixprec::adam_(params, grads, m, v, {}, {}, a, s); });
    EXPECT_EQ(checked, stepped);
    EXPECT_NE(checked.find(beta2 == 1.0 ? "mixprec::adam_: beta2 must be in [0, 1)" : "shares memory with"),
              std::string::npos)
        << checked;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(params[i], before[i]));
      EXPECT_TRUE(bitwise_equal(v[i], v_before[i]));
    }
  }
}

}  // namespace
