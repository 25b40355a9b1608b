// CPU kernels of the fused cross-entropy: each row streams once through L1-sized fp32 tiles with
// an online max / sum-of-exps (forward), or is rewritten as softmax minus one-hot (backward).
// The tile loops are branch-free fp32 arithmetic the compiler vectorizes (AVX2 clone on x86-64).
#include "kernels/cross_entropy.h"

#include <cmath>
#include <limits>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/simd.h"

namespace mixprec::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Independent accumulators per tile reduction: the vectorizer maps them onto two AVX2 registers,
// and they also shorten the fp32 summation chains (error grows with chain length, not with V).
constexpr int kLanes = 16;

// The plain max (NaN loses), which GCC turns into vmaxps; a NaN-keeping select here stayed
// scalar compares and jumps (3x slower rows). NaN needs no help from the max: it passes through
// exp into the row's sum, so lse and the loss come out NaN all the same.
MIXPREC_INLINE float fast_max(float a, float x) { return x > a ? x : a; }

// fp16/bf16 tiles through AVX2/F16C where the CPU has them: the portable bit-twiddling
// conversions kept the fp16 backward at 2.2x the bf16 one. Out-of-line (target attribute, which
// the default clone of the row functions could not inline), called once per tile.
#if MIXPREC_HAVE_X86_V3
template <DType D> MIXPREC_TARGET_V3 void load_tile_v3(const void* src, int64_t at, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_store_ps(dst + i, cpu::v3::load8<D>(src, at + i));
  for (; i < n; ++i) dst[i] = cpu::load_one<D>(src, at + i);
}

template <DType D> MIXPREC_TARGET_V3 void store_tile_v3(const float* src, void* dst, int64_t at, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) cpu::v3::store8<D>(dst, at + i, _mm256_load_ps(src + i));
  for (; i < n; ++i) cpu::store_one<D>(dst, at + i, src[i]);
}
#endif

void load_tile(DType d, const void* src, int64_t at, int64_t n, float* dst) {
#if MIXPREC_HAVE_X86_V3
  if (d != DType::kFloat32 && cpu::use_x86_v3())
    return d == DType::kFloat16 ? load_tile_v3<DType::kFloat16>(src, at, n, dst)
                                : load_tile_v3<DType::kBFloat16>(src, at, n, dst);
#endif
  cpu::load_tile(d, src, at, n, dst);
}

void store_tile(DType d, const float* src, void* dst, int64_t at, int64_t n) {
#if MIXPREC_HAVE_X86_V3
  if (d != DType::kFloat32 && cpu::use_x86_v3())
    return d == DType::kFloat16 ? store_tile_v3<DType::kFloat16>(src, dst, at, n)
                                : store_tile_v3<DType::kBFloat16>(src, dst, at, n);
#endif
  cpu::store_tile(d, src, dst, at, n);
}

// exp(x) for x <= 0 or NaN (every argument here is a logit minus the row's max or lse). libm's
// expf does not vectorize without -ffast-math, so: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite,
// ln2 split in two so n*ln2_hi is exact), then a degree-7 Taylor polynomial (truncation < 5e-9
// relative) times 2^n built in the exponent bits. Within ~2 ulp of exp. Below -87 the result
// would leave the normal range; it is flushed to 0, which no sum of exps here can notice (the
// row's max contributes exactly 1). NaN stays NaN: both selects keep x when it is NaN.
MIXPREC_INLINE float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // 12 significant bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723e-06f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float xc = x < -87.f ? -87.f : x;
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float scale = cpu::float_of(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);  // n in [-126, 0]
  return x < -87.f ? 0.f : p * scale;
}

MIXPREC_INLINE float tile_max(const float* x, int64_t n) {
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = -kInf;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = fast_max(acc[l], x[i + l]);
  for (int64_t l = 0; i + l < n; ++l) acc[l] = fast_max(acc[l], x[i + l]);
  float m = acc[0];
  for (int l = 1; l < kLanes; ++l) m = fast_max(m, acc[l]);
  return m;
}

MIXPREC_INLINE float tile_sum_exp(const float* x, int64_t n, float base) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += exp_nonpositive(x[i + l] - base);
  for (int64_t l = 0; i + l < n; ++l) acc[l] += exp_nonpositive(x[i + l] - base);
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

MIXPREC_INLINE float tile_sum(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  for (int64_t l = 0; i + l < n; ++l) acc[l] += x[i + l];
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// One row's log-sum-exp, reading the row once: a running max m and a sum s of exp(x - m) that is
// rescaled whenever a tile raises the max. A NaN anywhere makes s (so lse) NaN; a +inf makes
// inf - inf = NaN, as log_softmax does; -inf logits contribute exactly 0.
struct RowStats {
  float max;      // of the row's logits
  float log_sum;  // log(sum exp(x - max)), >= 0
};

MIXPREC_CPU_CLONES RowStats row_stats(DType d, const void* logits, int64_t row_begin, int64_t vocab) {
  alignas(64) float x[cpu::kTile];
  float m = -kInf, s = 0.f;
  for (int64_t at = 0; at < vocab; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, vocab - at);
    load_tile(d, logits, row_begin + at, len, x);
    const float new_m = fast_max(m, tile_max(x, len));
    // While every logit so far is -inf, exp(x - 0) = 0 keeps s at 0 (not exp(-inf + inf) = NaN).
    const float base = new_m == -kInf ? 0.f : new_m;
    s = s * exp_nonpositive(m - base) + tile_sum_exp(x, len, base);
    m = new_m;
  }
  return {m, std::log(s)};
}

// One element of a tensor of run-time dtype d, as fp32 (the target's logit).
float load_value(DType d, const void* p, int64_t i) {
  return cpu::with_dtype(d, [&](auto tag) { return cpu::load_one<decltype(tag)::value>(p, i); });
}

// The target's own gradient is -g * (sum of the other classes' probabilities), not
// g * (exp(x_t - lse) - 1): when the target dominates, the latter cancels to rounding noise of
// lse (fp32 lse of 50 is off by up to 2e-6, and 1 - p_t may be 1e-8), while the sum keeps every
// term's relative precision. The two are equal in exact arithmetic, and the row sums to zero.
MIXPREC_CPU_CLONES float row_grad(DType d, const void* logits, void* grad, int64_t row_begin, int64_t vocab, float lse,
                                  float g, int64_t target) {
  alignas(64) float x[cpu::kTile];
  float others = 0.f;
  for (int64_t at = 0; at < vocab; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, vocab - at);
    load_tile(d, logits, row_begin + at, len, x);
    // x - lse <= 0 for every finite logit, since lse >= the row's max.
    for (int64_t i = 0; i < len; ++i) x[i] = exp_nonpositive(x[i] - lse);
    if (target >= at && target < at + len) x[target - at] = 0.f;  // written for real after the row
    others += tile_sum(x, len);
    for (int64_t i = 0; i < len; ++i) x[i] *= g;
    store_tile(d, x, grad, row_begin + at, len);
  }
  return -g * others;
}

// One fp32 value rounded into element i of a tensor of run-time dtype d.
void store_value(DType d, void* p, int64_t i, float v) {
  cpu::with_dtype(d, [&](auto tag) { cpu::store_one<decltype(tag)::value>(p, i, v); });
}

// A row that gets no gradient (ignore_index), or only NaN (a target out of range), in the
// logits' dtype, through the same tile stores.
void row_fill(DType d, void* grad, int64_t row_begin, int64_t vocab, float value) {
  alignas(64) float x[cpu::kTile];
  for (int64_t i = 0; i < cpu::kTile; ++i) x[i] = value;
  for (int64_t at = 0; at < vocab; at += cpu::kTile)
    store_tile(d, x, grad, row_begin + at, std::min(cpu::kTile, vocab - at));
}

}  // namespace

void cross_entropy_forward_cpu(const CrossEntropyForwardParams& p, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t t = p.target[r];
    const RowStats st = row_stats(p.dtype, p.logits, r * p.vocab, p.vocab);
    p.lse[r] = st.max + st.log_sum;
    // (max - x_t) + log_sum, not lse - x_t: when the target dominates the row the loss is tiny
    // and lse - x_t would be all rounding error of lse; max - x_t is exact there (Sterbenz).
    if (t == p.ignore_index) p.losses[r] = 0.f;
    else if (!target_in_range(t, p.vocab)) p.losses[r] = kNaN;  // the CUDA contract; the CPU ops tier rejects it first
    else p.losses[r] = (st.max - load_value(p.dtype, p.logits, r * p.vocab + t)) + st.log_sum;
  }
}

void cross_entropy_backward_cpu(const CrossEntropyBackwardParams& p, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t t = p.target[r];
    if (t == p.ignore_index) row_fill(p.dtype, p.grad_logits, r * p.vocab, p.vocab, 0.f);
    else if (!target_in_range(t, p.vocab)) row_fill(p.dtype, p.grad_logits, r * p.vocab, p.vocab, kNaN);
    else
      store_value(p.dtype, p.grad_logits, r * p.vocab + t,
                  row_grad(p.dtype, p.logits, p.grad_logits, r * p.vocab, p.vocab, p.lse[r], p.grad_losses[r], t));
  }
}

}  // namespace mixprec::kernels
