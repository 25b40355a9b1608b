// Torch-free pieces every fused optimizer shares: the per-step device scalars (lr, step count,
// loss scale, found_inf), read the same way on CPU and CUDA, the step-count increment, and how a
// step reads and writes its weights (fp32 masters, bf16 + 16-bit remainders, stochastic rounding).
#pragma once

#include <cstring>

#include "kernels/float_bits.h"
#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// Scalars of one optimizer step. Each comes from the host or from a one-element float32 tensor
// on the op's device; the tensor wins when given, so a step can be captured in a CUDA graph.
struct StepScalars {
  float lr = 0.f;
  const float* lr_tensor = nullptr;
  float step = 0.f;                    // this step's count (>= 1) when step_tensor is null
  const float* step_tensor = nullptr;  // already incremented for this step (see increment_step_*)
  const float* grad_scale = nullptr;   // grads are divided by it (loss scale), null: unscaled
  const float* found_inf = nullptr;    // non-zero: the whole step does nothing
};

MIXPREC_HOST_DEVICE inline bool step_skipped(const StepScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.f;
}
MIXPREC_HOST_DEVICE inline float step_lr(const StepScalars& s) { return s.lr_tensor != nullptr ? *s.lr_tensor : s.lr; }
MIXPREC_HOST_DEVICE inline float step_count(const StepScalars& s) {
  return s.step_tensor != nullptr ? *s.step_tensor : s.step;
}
MIXPREC_HOST_DEVICE inline float grad_inv_scale(const StepScalars& s) {
  return s.grad_scale != nullptr ? 1.f / *s.grad_scale : 1.f;
}

// torch's fused-optimizer contract (aten::_fused_adam_ on CPU and CUDA, Apex's FusedAdam): a step
// given a grad_scale leaves every gradient unscaled, g * (1/scale) as the update used it, rounded
// to the grad's dtype, so code that clips or logs grads after scaler.step sees true values. The
// pass that reads g stores it back (2-4 more bytes per param); a skipped step (found_inf) returns
// before any store, so grads keep their scaled values, as torch's do. Without a grad_scale the
// gradient is not written at all.
MIXPREC_HOST_DEVICE inline bool stores_unscaled_grads(const StepScalars& s) { return s.grad_scale != nullptr; }

// ---- the weight a step updates, the same for every family -----------------------------------
// Where the fp32 weight comes from and where it goes: the param itself (rounded to its dtype, to
// nearest or stochastically), or a master beside it: fp32, or the low 16 bits of an fp32 master
// whose high half is the bf16 param ("remainder": 2 + 2 bytes per param instead of 2 + 4).
struct WeightMode {
  int param_list = 0;  // the family's list indices (kAdamParam, kAdamMaster ...)
  int master_list = 0;
  bool has_master = false;  // master_list is live (else it stands in for params, never touched)
  bool remainder = false;   // this group's masters are remainders (per group: set_group, ops/optim.h)
  bool stochastic = false;  // no master, bf16 params: stochastic rounding (per group too)
  uint64_t seed = 0;
};

// Remainder masters. An fp32 master M is kept as (W, R): R = the low 16 bits of M, W = the bf16
// nearest M with ties going to the lower bit pattern (toward zero). W is what the model computes
// with; it equals torch's round-to-nearest-even bf16 of M except at exact ties (1 in 65536), where
// it is the other, equally near, neighbour. Not RNE itself: an even W is the RNE rounding of
// 65537 fp32 values, one more than 16 bits tell apart, whereas ties-down leaves exactly 65536 per
// W, so M = (W, R) is rebuilt bit for bit: W's high half went up by one exactly when R > 0x8000.
// NaN masters stay NaN (W is made quiet; the rebuilt NaN may differ in payload).
MIXPREC_HOST_DEVICE inline void split_master(float master, uint16_t& weight, uint16_t& remainder) {
  const uint32_t u = float_bits(master);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  weight = static_cast<uint16_t>(nan ? (u >> 16) | 0x40u : (u + 0x7fffu) >> 16);
  remainder = static_cast<uint16_t>(u);
}
MIXPREC_HOST_DEVICE inline float rebuild_master(uint32_t weight, uint32_t remainder) {
  const uint32_t high = weight - (remainder > 0x8000u ? 1u : 0u);
  return bits_float((high << 16) | remainder);
}

// Stochastic rounding to bf16 from a counter-based hash: the random bits of an element depend on
// (seed, step, tensor's position in the op's lists, element index) only, never on the thread
// layout, so CPU and CUDA round identically and a resumed run repeats them. lowbias32 (Wellons):
// a bijective 32-bit mixer with a low avalanche bias; chained, each input word is fully mixed.
MIXPREC_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// One tensor's key for one step; `step` is the step count (a whole number below 2^24 in float).
MIXPREC_HOST_DEVICE inline uint32_t rounding_key(uint64_t seed, float step, int32_t tensor) {
  uint32_t k = mix32(static_cast<uint32_t>(seed) ^ 0x9e3779b9u);
  k = mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = mix32(k ^ static_cast<uint32_t>(step));
  return mix32(k + static_cast<uint32_t>(tensor));
}
MIXPREC_HOST_DEVICE inline uint32_t rounding_bits(uint32_t key, int64_t index) {
  return mix32(mix32(static_cast<uint32_t>(index) ^ key) + static_cast<uint32_t>(index >> 32));
}
// x rounded to bf16 (its bits): up with probability (distance to the lower neighbour) / ulp, so
// E[result] = x. Adding 16 random bits below the cut carries into the kept half exactly that
// often. inf stays inf, NaN stays NaN (quiet); a finite x within an ulp of the largest bf16 can
// round to inf, as the nearest rounding of it would at the halfway point.
MIXPREC_HOST_DEVICE inline uint16_t bf16_round_stochastic(float x, uint32_t random) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u)
    return static_cast<uint16_t>((u & 0x7fffffu) != 0 ? (u >> 16) | 0x40u : u >> 16);
  return static_cast<uint16_t>((u + (random & 0xffffu)) >> 16);
}

// step_tensor += 1 unless found_inf is set. Runs before the update kernel, so every block of
// that kernel reads the same, already incremented, count.
void increment_step_cpu(float* step_tensor, const float* found_inf);
void increment_step_cuda(float* step_tensor, const float* found_inf, Stream stream);

}  // namespace mixprec::kernels
