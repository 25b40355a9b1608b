// Torch-free entry points of the loss-scaling kernels (non-finite check and unscale, scale
// update) for CPU and CUDA. The ops tier fills these structs and calls them.
#pragma once

#include <cmath>

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// Lists: 0 = grads (read), 1 = out (written; the same pointers as list 0 when in place).
// A group with num_lists == 1 and inv_scale == nullptr is the read-only check.
struct UnscaleParams {
  const TensorGroup* group = nullptr;
  // Set to 1 when any element is inf or NaN, or (with inv_scale) when inv_scale itself is inf,
  // NaN or zero: a scale of 0, inf or NaN must never let its products reach an optimizer step.
  float* found_inf = nullptr;         // may be null
  const float* inv_scale = nullptr;   // device scalar multiplied in; null: check only
  float* per_tensor_found = nullptr;  // [num args] set to 1 for each tensor holding inf/NaN
};

// Whether a multiplier read from inv_scale makes the unscaled gradients meaningless: inf, NaN
// (the scale was 0 or NaN) or zero (the scale was inf). Such a call flags every tensor it visits.
MIXPREC_HOST_DEVICE inline bool is_bad_inv_scale(float s) {
  return !(s - s == 0.f) || s == 0.f;  // s - s is NaN exactly for inf and NaN
}

// Runs chunks [chunk_begin, chunk_end) of p.group on the calling thread.
void non_finite_check_and_unscale_cpu(const UnscaleParams& p, int64_t chunk_begin, int64_t chunk_end);
// Runs the whole group on `stream`, in as many launches as its size needs.
void non_finite_check_and_unscale_cuda(const UnscaleParams& p, Stream stream);

// Dynamic loss-scale update, one thread of work; all pointers are single device (or host) values.
struct ScaleUpdateParams {
  float* scale = nullptr;
  int32_t* growth_tracker = nullptr;      // successful steps since the last change of scale
  int32_t* hysteresis_tracker = nullptr;  // overflows still tolerated; null means hysteresis 1
  int64_t* skipped_steps = nullptr;       // incremented on every overflow; may be null
  const float* found_inf = nullptr;
  // Factors and bounds stay double: torch multiplies the float scale by the double factor and
  // rounds once, and matching it bit for bit needs the same (e.g. backoff 0.3 is not a float).
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int32_t growth_interval = 2000;
  int32_t hysteresis = 1;
  double min_scale = 0.0;
  double max_scale = 0.0;  // 0: unbounded (only kept finite, as torch does)
};

// The lowest scale a backoff produces whatever min_scale says: the smallest positive normal
// float32 (FLT_MIN, 2^-126). Without it 180 overflows in a row take 65536 to 0, whose inverse is
// inf; at 2^-126 the inverse (2^126) is still finite.
constexpr double kScaleFloor = 1.1754943508222875e-38;

// The scale update itself, shared verbatim by the CPU function and the one-thread CUDA kernel.
MIXPREC_HOST_DEVICE inline void update_scale_step(const ScaleUpdateParams& p) {
  const float scale = *p.scale;
  if (*p.found_inf != 0.f) {
    if (p.skipped_steps != nullptr) *p.skipped_steps += 1;
    *p.growth_tracker = 0;
    // Hysteresis: back off only on the hysteresis-th overflow since the last change of scale.
    int32_t tolerated = p.hysteresis_tracker != nullptr ? *p.hysteresis_tracker - 1 : 0;
    if (tolerated <= 0) {
      // A NaN scale stays NaN, as in torch (fmax would turn it into the floor): every step with it
      // is skipped, since its inverse is NaN, and the weights stay as they were.
      if (scale == scale)
        *p.scale =
            static_cast<float>(fmax(static_cast<double>(scale) * p.backoff_factor, fmax(p.min_scale, kScaleFloor)));
      tolerated = p.hysteresis;
    }
    if (p.hysteresis_tracker != nullptr) *p.hysteresis_tracker = tolerated;
    return;
  }
  const int32_t successful = *p.growth_tracker + 1;
  if (successful >= p.growth_interval) {
    double grown = static_cast<double>(scale) * p.growth_factor;
    if (p.max_scale > 0.0) grown = fmin(grown, p.max_scale);
    // Like torch: never grow into inf (as a float). Finite test: inf - inf and NaN - NaN are NaN.
    const float g = static_cast<float>(grown);
    if (g - g == 0.f) *p.scale = g;
    *p.growth_tracker = 0;
    if (p.hysteresis_tracker != nullptr) *p.hysteresis_tracker = p.hysteresis;
  } else {
    *p.growth_tracker = successful;
  }
}

void update_scale_cpu(const ScaleUpdateParams& p);
void update_scale_cuda(const ScaleUpdateParams& p, Stream stream);

}  // namespace mixprec::kernels
