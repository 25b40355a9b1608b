// The checks of every error in the ops tier and the C++ front (csrc/api), MIXPREC_CHECK*, and the
// num() and shape() they need: numbers and shapes as std::string, built without std::ostream.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/SymInt.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <string_view>
#include <type_traits>

// Why: on the H200 machine's toolchain (GCC 13.3, torch 2.11, loaded into a Python process) a
// number streamed through std::ostream by code compiled into libmixprec crashed in std::num_put
// while the error message was being built, so a ValueError became a segfault. Strings, const char*,
// c10::ScalarType (its inline operator<< writes a const char*) and c10::Device (operator<< out of
// line, in libc10) stream safely; ints, doubles and ArrayRef (an inline template that streams its
// ints here) do not. TORCH_CHECK* streams every message argument, so csrc/ checks through the
// MIXPREC_CHECK* wrappers below, which refuse to compile a message argument that is not text: a
// number or shape goes through num() or shape() first.
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

// ---- the checks: TORCH_CHECK* whose message arguments are checked at compile time ------------
// Every check in csrc/ goes through these (tests/python/test_error_messages_format.py fails on a
// direct TORCH_CHECK*, TORCH_WARN* or c10::str). A message argument must be text: std::string,
// const char*, a char or a string_view, or c10::Device / c10::ScalarType (see above). Anything
// else, a number or shape above all, fails to compile here, naming the call through its macro
// expansion; never evaluated, the check costs nothing at run time.
namespace mixprec::detail {

template <class T>
inline constexpr bool kMessageText =
    std::is_same_v<T, std::string> || std::is_same_v<T, const char*> || std::is_same_v<T, char*> ||
    std::is_same_v<T, char> || std::is_same_v<T, std::string_view> || std::is_same_v<T, c10::Device> ||
    std::is_same_v<T, c10::ScalarType>;

// Declared, never defined: only its type, in decltype, is used. The first argument is the condition.
template <class Cond, class... Args>
std::bool_constant<(kMessageText<std::decay_t<Args>> && ...)> message_is_text(const Cond&, const Args&...);

}  // namespace mixprec::detail

#define MIXPREC_CHECKED_(CHECK, ...)                                                                  \
  do {                                                                                                \
    static_assert(decltype(::mixprec::detail::message_is_text(__VA_ARGS__))::value,                   \
                  "mixprec: an error-message argument is not text: wrap numbers in num() and shapes " \
                  "in shape() (csrc/ops/format.h says why)");                                         \
    CHECK(__VA_ARGS__);                                                                               \
  } while (0)
#define MIXPREC_CHECK(...) MIXPREC_CHECKED_(TORCH_CHECK, __VA_ARGS__)                      // RuntimeError
#define MIXPREC_CHECK_VALUE(...) MIXPREC_CHECKED_(TORCH_CHECK_VALUE, __VA_ARGS__)          // ValueError
#define MIXPREC_CHECK_TYPE(...) MIXPREC_CHECKED_(TORCH_CHECK_TYPE, __VA_ARGS__)            // TypeError
#define MIXPREC_CHECK_INDEX(...) MIXPREC_CHECKED_(TORCH_CHECK_INDEX, __VA_ARGS__)          // IndexError
#define MIXPREC_INTERNAL_ASSERT(...) MIXPREC_CHECKED_(TORCH_INTERNAL_ASSERT, __VA_ARGS__)  // a bug of ours
