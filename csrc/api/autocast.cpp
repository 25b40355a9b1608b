// mixprec::amp::AutocastGuard (include/mixprec/amp.h): torch.autocast's enter/exit protocol on
// ATen's per-device-type autocast state (the at::autocast API of torch 2.4 and newer).
#include <mixprec/amp.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include "ops/format.h"  // MIXPREC_CHECK*

namespace mixprec::amp {

AutocastGuard::AutocastGuard(c10::DeviceType device_type, std::optional<c10::ScalarType> dtype, bool enabled,
                             std::optional<bool> cache_enabled)
    : device_type_(device_type) {
  // Everything is checked before any state changes, so a failed construction changes nothing.
  MIXPREC_CHECK_VALUE(at::autocast::is_autocast_available(device_type),
                      "mixprec::amp::AutocastGuard: autocast is not available for device type ",
                      c10::DeviceTypeName(device_type, /*lower_case=*/true));
  const c10::ScalarType d = dtype.value_or(at::autocast::get_autocast_dtype(device_type));
  MIXPREC_CHECK_VALUE(d == c10::kHalf || d == c10::kBFloat16, "mixprec::amp::AutocastGuard: dtype must be float16 or ",
                      "bfloat16, got ", d);
  prev_enabled_ = at::autocast::is_autocast_enabled(device_type);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_type);
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  // The order of torch.autocast.__enter__.
  at::autocast::set_autocast_enabled(device_type, enabled);
  at::autocast::set_autocast_dtype(device_type, d);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled.value_or(prev_cache_enabled_));
}

AutocastGuard::~AutocastGuard() {
  // Cached casts of weights belong to the outermost region: they go when it ends.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace mixprec::amp
