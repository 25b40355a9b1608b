// Shared helpers of mixprec's GoogleTest suite: per-test random seeds, a fixture run on CPU and
// (when present) CUDA, float64 error measures, bitwise comparison, inf/NaN injection and checks
// that a failing op names its op, argument and index and leaves its inputs as they were.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace mixprec::test {

// Fresh inputs every run, yet repeatable: the base seed comes from MIXPREC_TEST_SEED or the OS,
// is printed once per process, and every test mixes its own name into it, so a single failing
// test reproduces under --gtest_filter with the same MIXPREC_TEST_SEED.
inline uint64_t base_seed() {
  static const uint64_t seed = [] {
    uint64_t s;
    if (const char* env = std::getenv("MIXPREC_TEST_SEED")) {
      s = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device rd;
      s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
    std::fprintf(stderr, "[mixprec tests] random seed %llu (set MIXPREC_TEST_SEED=%llu to repeat)\n",
                 static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// Seeds torch's generators (CPU, and CUDA when present) for the running test; returns the seed.
inline uint64_t seed_current_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info != nullptr ? std::string(info->test_suite_name()) + "." + info->name() : "";
  const uint64_t seed = (base_seed() ^ std::hash<std::string>{}(name)) & ((uint64_t{1} << 62) - 1);
  torch::manual_seed(seed);
  return seed;
}

// A host RNG for sizes, positions and factors, seeded from torch's seeded generator so that it
// follows the per-test seed too.
inline std::mt19937_64 host_rng() {
  return std::mt19937_64(static_cast<uint64_t>(torch::randint(1LL << 62, {1}).item<int64_t>()));
}

#define MIXPREC_SKIP_WITHOUT_CUDA()                                     \
  do {                                                                  \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// Base of every op test: parameterized by device type, skipped on CUDA without a GPU, seeded.
class DeviceTest : public ::testing::TestWithParam<c10::DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == c10::kCUDA) MIXPREC_SKIP_WITHOUT_CUDA();
    seed_current_test();
  }
  // cuda:0 rather than "cuda", so that it compares equal to the device of the tensors made on it.
  c10::Device device() const { return GetParam() == c10::kCUDA ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU); }
  at::TensorOptions opts(at::ScalarType dtype = at::kFloat) const {
    return at::TensorOptions().dtype(dtype).device(device());
  }
};

inline std::string device_param_name(const ::testing::TestParamInfo<c10::DeviceType>& info) {
  return info.param == c10::kCUDA ? "CUDA" : "CPU";
}

#define MIXPREC_INSTANTIATE_DEVICE_TESTS(Fixture)                                      \
  INSTANTIATE_TEST_SUITE_P(Devices, Fixture, ::testing::Values(c10::kCPU, c10::kCUDA), \
                           ::mixprec::test::device_param_name)

// Sizes on both sides of the 65536-element chunk, tiny ones, and a few random ones.
inline std::vector<int64_t> boundary_sizes(std::mt19937_64& rng) {
  std::vector<int64_t> s{1, 7, 65535, 65536, 65537, 2 * 65536 + 1};
  std::uniform_int_distribution<int64_t> small(2, 5000), large(65538, 4 * 65536);
  s.push_back(small(rng));
  s.push_back(large(rng));
  return s;
}

// Normal values times `magnitude`, stored in `dtype` on `device` (generated on the CPU so the
// device does not change the values a seed produces).
inline at::Tensor random_tensor(at::IntArrayRef shape, at::ScalarType dtype, const c10::Device& device,
                                double magnitude = 1.0) {
  return (torch::randn(shape, torch::kFloat) * magnitude).to(dtype).to(device);
}

inline std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> c;
  c.reserve(ts.size());
  for (const auto& t : ts) c.push_back(t.clone());
  return c;
}

// Same dtype, shape and bits (NaN payloads included): "nothing was modified".
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  if (a.numel() == 0) return true;
  const at::ScalarType as_int = a.element_size() == 2   ? at::kShort
                                : a.element_size() == 4 ? at::kInt
                                : a.element_size() == 8 ? at::kLong
                                                        : at::kByte;
  return torch::equal(a.contiguous().view(as_int).cpu(), b.contiguous().view(as_int).cpu());
}

// Bitwise equal except that any NaN equals any NaN (payloads may differ between implementations).
inline bool equal_nan_aware(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  const at::Tensor an = a.isnan(), bn = b.isnan();
  if (!torch::equal(an, bn)) return false;
  return bitwise_equal(a.masked_fill(an, 0), b.masked_fill(bn, 0));
}

// ‖out − ref‖₂ / ‖ref‖₂ in float64 over all elements (absolute norm if ref is zero). NaN or inf
// anywhere makes it NaN or inf, so a non-finite result never passes a `<` bound.
inline double rel_err(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = out.to(torch::kCPU, torch::kDouble).reshape(-1);
  const at::Tensor r = ref.to(torch::kCPU, torch::kDouble).reshape(-1);
  const double num = (o - r).norm().item<double>();
  const double den = r.norm().item<double>();
  if (!std::isfinite(num)) return std::numeric_limits<double>::infinity();
  return den > 0 ? num / den : num;
}

// All of `ts` as one float64 CPU vector.
inline at::Tensor flat64(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  for (const auto& t : ts) parts.push_back(t.detach().to(torch::kCPU, torch::kDouble).reshape(-1));
  return parts.empty() ? torch::empty({0}, torch::kDouble) : torch::cat(parts);
}

// ‖(a − start) − (b − start)‖ / ‖b − start‖: the error of the displacement, which a small wrong
// term in the update cannot hide behind the size of the weights.
inline double displacement_err(const at::Tensor& a, const at::Tensor& b, const at::Tensor& start) {
  const at::Tensor s = start.detach().to(at::kCPU, at::kDouble);
  return rel_err(a.detach().to(at::kCPU, at::kDouble) - s, b.detach().to(at::kCPU, at::kDouble) - s);
}

// The same over a list of tensors taken as one vector. Against a float64 reference, judge lists:
// a 1-element tensor's displacement over a few steps (a sum of updates of random sign) can nearly
// cancel, and its relative error then measures the cancellation, not the kernel (1.08e-5 seen).
inline double displacement_err(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                               const std::vector<at::Tensor>& start) {
  return displacement_err(flat64(a), flat64(b), flat64(start));
}

inline double rel_err(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& ref) {
  return rel_err(flat64(out), flat64(ref));
}

// The bound docs/architecture.md sets for a result stored in `dtype`: 1e-5 relative in fp32; in fp16/bf16,
// twice the error plain PyTorch makes (`peer`, computed the ordinary way in that precision).
inline double error_bound(at::ScalarType dtype, const at::Tensor& peer, const at::Tensor& ref64) {
  if (dtype == at::kFloat) return 1e-5;
  return 2.0 * rel_err(peer, ref64) + 1e-12;
}

// Writes `value` at flat positions `pos` of the contiguous tensor `t` (any device).
inline void inject(const at::Tensor& t, const std::vector<int64_t>& pos, double value) {
  at::Tensor flat = t.view({-1});
  for (int64_t i : pos) flat[i].fill_(value);
}

// The positions docs/architecture.md asks for: first, last and one random element.
inline std::vector<int64_t> first_last_random(int64_t numel, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> pick(0, numel - 1);
  return {0, numel - 1, pick(rng)};
}

inline const double kInf = std::numeric_limits<double>::infinity();
inline const double kNaN = std::numeric_limits<double>::quiet_NaN();

// Runs `fn`, which must throw c10::Error whose message (without backtrace) contains every one of
// `needles`; returns the message.
inline std::string expect_c10_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    return msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected c10::Error, got std::exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected c10::Error naming " << (needles.empty() ? "" : needles.back()) << ", nothing thrown";
  return "";
}

// Asserts every tensor in `now` is bitwise what it was in `before` (clones taken before the call).
inline void expect_unchanged(const std::vector<at::Tensor>& now, const std::vector<at::Tensor>& before,
                             const std::string& what) {
  ASSERT_EQ(now.size(), before.size());
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(bitwise_equal(now[i], before[i])) << what << "[" << i << "] was modified";
}

}  // namespace mixprec::test
