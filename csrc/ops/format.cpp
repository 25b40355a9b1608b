// std::string formatting of numbers and shapes for error messages, without std::ostream (format.h).
#include "ops/format.h"

#include <c10/core/SymNodeImpl.h>

#include <cstdio>
#include <cstdlib>

namespace mixprec::detail {

std::string num(double v) {
  // snprintf and strtod, not std::to_chars: the floating-point to_chars needs a libstdc++ newer
  // than some Python environments load, and this runs only on an error path.
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;  // NaN never compares equal: it ends at 17 as "nan"
  }
  return buf;
}

std::string num(const c10::SymInt& v) {
  if (const auto concrete = v.maybe_as_int()) return std::to_string(*concrete);
  return v.toSymNode()->str();
}

std::string shape(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

std::string shape(c10::SymIntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + num(sizes[i]);
  return s + "]";
}

}  // namespace mixprec::detail
