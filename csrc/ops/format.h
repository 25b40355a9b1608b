// Numbers and shapes for error messages as std::string, built without std::ostream; used by every
// error message in the ops tier and the C++ front (csrc/api).
#pragma once

#include <c10/core/SymInt.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/util/ArrayRef.h>

#include <string>
#include <type_traits>

// Why: on the H200 machine's toolchain (GCC 13.3, torch 2.11, loaded into a Python process) a
// number streamed through std::ostream by code compiled into libmixprec crashed in std::num_put
// while the error message was being built, so a ValueError became a segfault. Strings, const char*,
// c10::ScalarType (its inline operator<< writes a const char*) and c10::Device (operator<< out of
// line, in libc10) stream safely; ints, doubles and ArrayRef (an inline template that streams its
// ints here) do not. TORCH_CHECK*, TORCH_WARN* and c10::str stream every message argument, so a
// number or shape passed to them goes through num() or shape() first. tests/python/
// test_error_messages_format.py scans csrc/ and fails on any other argument.
//
// Where: the header sits in ops/ beside its users but is a leaf: it includes only c10 and the
// standard library and declares nothing of the ops tier, so the C++ front (api/api_util.h) includes
// it without reaching into op internals; both tiers are compiled into the one libmixprec.

namespace mixprec::detail {

// The shortest text that reads back as v ("0.1", "1e-08", "-inf", "nan"), as Python's repr would.
std::string num(double v);

// Every integer type (int, int64_t, size_t, long long ...): std::to_string, no locale involved.
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
std::string num(T v) {
  return std::to_string(v);
}

// A bool reads better as a word chosen at the call site ("true"/"enabled"): write it as a ternary.
std::string num(bool) = delete;

// A possibly symbolic integer (sym_numel(), a sym_sizes() entry): its value, or its expression.
std::string num(const c10::SymInt& v);

// "[2, 3]" for sizes(); "[]" for a 0-dim tensor.
std::string shape(c10::IntArrayRef sizes);

// "[s0, 3]" for sym_sizes() of torch.compile's fake tensors, "[2, 3]" when all are concrete.
std::string shape(c10::SymIntArrayRef sizes);

}  // namespace mixprec::detail
