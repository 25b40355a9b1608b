// Copies of small tensors (scales, found_inf flags, norms) between devices, without a host sync
// wherever that is safe: the C++ twin of python/mixprec/_device_copy.py.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mixprec::detail {

// `t` on `device` (and `dtype`). A copy to an accelerator is queued on its stream (non-blocking);
// a copy to the CPU blocks: CPU kernels read their inputs at once, and a non-blocking
// device-to-CPU copy lands in pinned memory still in flight (a CPU group beside GPU ones would
// read a stale scale, flag or norm).
inline at::Tensor to_device(const at::Tensor& t, const at::Device& device,
                            std::optional<at::ScalarType> dtype = std::nullopt) {
  return t.to(device, dtype.value_or(t.scalar_type()), /*non_blocking=*/!device.is_cpu());
}

}  // namespace mixprec::detail
