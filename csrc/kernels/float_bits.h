// A float's bit pattern and back, on the host and the device: the remainder masters, stochastic
// rounding and the FP8 casts work on the bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

MIXPREC_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MIXPREC_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

}  // namespace mixprec::kernels
