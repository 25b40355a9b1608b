// multi_tensor_norm called through the public C++ header on CPU and CUDA: 2- and inf-norms,
// total and per tensor, against float64 references of the stored values.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "test_support.h"

namespace {

using namespace mixprec::test;

const at::ScalarType kFloatTypes[] = {at::kFloat, at::kHalf, at::kBFloat16};

// The norm of the stored values, in float64 (0 for an empty tensor).
double ref_norm(const at::Tensor& t, double ord) {
  if (t.numel() == 0) return 0.0;
  const at::Tensor d = t.to(torch::kCPU, torch::kDouble);
  return ord == 2.0 ? d.norm().item<double>() : d.abs().max().item<double>();
}

double ref_total(const std::vector<at::Tensor>& ts, double ord) {
  double acc = 0.0;
  for (const auto& t : ts) {
    const double n = ref_norm(t, ord);
    acc = ord == 2.0 ? acc + n * n : std::max(acc, n);
  }
  return ord == 2.0 ? std::sqrt(acc) : acc;
}

// fp32 accumulation of exactly representable inputs: 1e-5 relative for the 2-norm; the
// inf-norm is one of the inputs, so it must be exact.
void expect_norm(float got, double ref, double ord, const std::string& what) {
  if (ord == 2.0)
    EXPECT_LT(std::abs(got - ref), 1e-5 * ref + 1e-30) << what << ": got " << got << ", float64 says " << ref;
  else EXPECT_EQ(got, static_cast<float>(ref)) << what;
}

class Norm : public DeviceTest {
 protected:
  // Checks shapes, dtypes and devices of both outputs, then every value against float64.
  void check(const std::vector<at::Tensor>& ts, double ord, bool per_tensor) {
    SCOPED_TRACE("ord " + std::to_string(ord) + (per_tensor ? ", per tensor" : ""));
    const auto [total, per] = mixprec::multi_tensor_norm(ts, ord, per_tensor);
    EXPECT_EQ(total.dim(), 0);
    EXPECT_EQ(total.scalar_type(), at::kFloat);
    EXPECT_EQ(per.scalar_type(), at::kFloat);
    EXPECT_EQ(total.device(), device());
    EXPECT_EQ(per.device(), device());
    ASSERT_EQ(per.dim(), 1);
    ASSERT_EQ(per.size(0), per_tensor ? static_cast<int64_t>(ts.size()) : 0);
    expect_norm(total.item<float>(), ref_total(ts, ord), ord, "total");
    const at::Tensor p = per.cpu();
    for (int64_t i = 0; i < p.numel(); ++i)
      expect_norm(p[i].item<float>(), ref_norm(ts[i], ord), ord, "per_tensor[" + std::to_string(i) + "]");
  }
};
MIXPREC_INSTANTIATE_DEVICE_TESTS(Norm);

TEST_P(Norm, MatchesFloat64ReferenceAcrossChunkBoundariesAndDtypes) {
  auto rng = host_rng();
  std::vector<at::Tensor> ts;
  const auto sizes = boundary_sizes(rng);
  for (size_t i = 0; i < sizes.size(); ++i)
    ts.push_back(random_tensor({sizes[i]}, kFloatTypes[i % 3], device(), std::exp2(static_cast<double>(i % 5) - 2)));
  ts.push_back(random_tensor({65537 + 1}, at::kBFloat16, device()).narrow(0, 1, 65537));  // unaligned view
  ts.push_back(random_tensor({3, 70, 5}, at::kHalf, device()));                           // not 1-D
  for (double ord : {2.0, kInf})
    for (bool per_tensor : {true, false}) check(ts, ord, per_tensor);

  // Fixed reduction order: the same inputs give the same bits.
  const auto [a, pa] = mixprec::multi_tensor_norm(ts, 2.0, true);
  const auto [b, pb] = mixprec::multi_tensor_norm(ts, 2.0, true);
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_TRUE(bitwise_equal(pa, pb));
}

TEST_P(Norm, InfAndNaNPropagateToTotalAndOwnTensorOnly) {
  auto rng = host_rng();
  const std::vector<int64_t> sizes{7, 65535, 65537};
  for (double value : {kInf, -kInf, kNaN}) {
    for (int where = 0; where < 3; ++where) {
      std::vector<at::Tensor> ts;
      for (size_t i = 0; i < sizes.size(); ++i)
        ts.push_back(random_tensor({sizes[i]}, kFloatTypes[(i + where) % 3], device()));
      const int64_t t = std::uniform_int_distribution<int64_t>(0, ts.size() - 1)(rng);
      const int64_t pos = first_last_random(ts[t].numel(), rng)[where];
      inject(ts[t], {pos}, value);
      SCOPED_TRACE("value " + std::to_string(value) + " in tensors[" + std::to_string(t) + "] at " +
                   std::to_string(pos));
      for (double ord : {2.0, kInf}) {
        const auto [total, per] = mixprec::multi_tensor_norm(ts, ord, true);
        const at::Tensor p = per.cpu();
        const auto expect_bad = [&](float x, const std::string& what) {
          if (std::isnan(value)) EXPECT_TRUE(std::isnan(x)) << what << " = " << x << " hides a NaN, ord " << ord;
          else EXPECT_EQ(x, std::numeric_limits<float>::infinity()) << what << ", ord " << ord;
        };
        expect_bad(total.item<float>(), "total");
        for (int64_t i = 0; i < static_cast<int64_t>(ts.size()); ++i) {
          if (i == t) expect_bad(p[i].item<float>(), "per_tensor[" + std::to_string(i) + "]");
          else expect_norm(p[i].item<float>(), ref_norm(ts[i], ord), ord, "per_tensor[" + std::to_string(i) + "]");
        }
      }
    }
  }
}

TEST_P(Norm, ZeroSizeTensors) {
  for (double ord : {2.0, kInf}) {
    // Zero-size tensors get no kernel: their per-tensor entries must still be written (0).
    const std::vector<at::Tensor> all_empty{torch::empty({0}, opts()), torch::empty({2, 0}, opts(at::kHalf))};
    check(all_empty, ord, true);
    check(all_empty, ord, false);
    const std::vector<at::Tensor> mixed{torch::empty({0}, opts(at::kBFloat16)),
                                        random_tensor({65537}, at::kHalf, device()), torch::empty({0, 4}, opts()),
                                        random_tensor({5}, at::kFloat, device())};
    check(mixed, ord, true);
  }
}

TEST_P(Norm, EmptyListIsZero) {
  // No tensor tells the dispatcher a device: the op must still answer (0, empty), like torch's
  // norm of nothing.
  for (double ord : {2.0, kInf}) {
    const auto [total, per] = mixprec::multi_tensor_norm({}, ord, true);
    EXPECT_EQ(total.dim(), 0);
    EXPECT_EQ(total.scalar_type(), at::kFloat);
    EXPECT_EQ(total.item<float>(), 0.f);
    EXPECT_EQ(per.numel(), 0);
  }
}

TEST_P(Norm, MoreTensorsThanOneLaunchTableHolds) {
  // One dtype, so one group larger than a launch's table (~1090 tensors for one list).
  auto rng = host_rng();
  std::uniform_int_distribution<int64_t> size(1, 600);
  for (at::ScalarType dtype : {at::kHalf, at::kFloat}) {
    std::vector<at::Tensor> ts;
    for (int i = 0; i < 1300; ++i) ts.push_back(random_tensor({size(rng)}, dtype, device()));
    for (double ord : {2.0, kInf}) check(ts, ord, true);
  }
}

TEST_P(Norm, ErrorsNameOpArgumentAndIndexAndModifyNothing) {
  std::vector<at::Tensor> ts{random_tensor({100}, at::kFloat, device()), random_tensor({65537}, at::kHalf, device()),
                             random_tensor({3}, at::kBFloat16, device())};
  const auto run = [&](std::vector<at::Tensor> args, double ord, const std::string& arg) {
    SCOPED_TRACE(arg);
    const auto before = clone_all(args);
    expect_c10_error([&] { mixprec::multi_tensor_norm(args, ord, true); }, {"mixprec::multi_tensor_norm", arg});
    expect_unchanged(args, before, "tensors");
  };
  const auto with = [&](size_t i, at::Tensor t) {
    auto v = ts;
    v[i] = t;
    return v;
  };
  for (double ord : {1.0, 0.0, 3.0, -kInf, kNaN}) run(ts, ord, "ord");
  run(with(2, torch::ones({3}, opts(at::kDouble))), 2.0, "tensors[2]");
  run(with(2, torch::ones({3}, opts(at::kInt))), 2.0, "tensors[2]");
  // Dense layouts (a transpose, channels_last) are fine for a sum; skipping memory is not.
  run(with(1, torch::ones({20, 60}, opts()).slice(1, 0, 60, 2)), 2.0, "tensors[1]");
  run(with(2, torch::ones({6}, opts()).slice(0, 0, 6, 2)), kInf, "tensors[2]");
  if (device().is_cuda()) run(with(2, ts[2].cpu()), 2.0, "tensors[2]");
}

}  // namespace
