// Private helpers of the C++ front (csrc/api): typed reads of torch::serialize archives that fail
// naming the checkpoint field (a corrupt checkpoint never loads half-way), and hyper-parameter checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "ops/format.h"  // num(), shape(): numbers in errors never go through std::ostream (see there)

namespace mixprec::detail::api {

inline c10::IValue read_ivalue(torch::serialize::InputArchive& archive, const std::string& key,
                               const std::string& where) {
  c10::IValue v;
  MIXPREC_CHECK_VALUE(archive.try_read(key, v), where, ": the checkpoint has no '", key, "'");
  return v;
}

// A value of `key` as a number, an integer or a bool; errors name `where` and the key.
inline double ivalue_double(const c10::IValue& v, const std::string& key, const std::string& where) {
  MIXPREC_CHECK_VALUE(v.isDouble() || v.isInt(), where, ": '", key, "' must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

inline int64_t ivalue_int(const c10::IValue& v, const std::string& key, const std::string& where) {
  MIXPREC_CHECK_VALUE(v.isInt(), where, ": '", key, "' must be an integer, got ", v.tagKind());
  return v.toInt();
}

inline bool ivalue_bool(const c10::IValue& v, const std::string& key, const std::string& where) {
  MIXPREC_CHECK_VALUE(v.isBool(), where, ": '", key, "' must be a bool, got ", v.tagKind());
  return v.toBool();
}

inline double read_double(torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
  return ivalue_double(read_ivalue(archive, key, where), key, where);
}

inline int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
  return ivalue_int(read_ivalue(archive, key, where), key, where);
}

inline bool read_bool(torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
  return ivalue_bool(read_ivalue(archive, key, where), key, where);
}

inline std::string read_string(torch::serialize::InputArchive& archive, const std::string& key,
                               const std::string& where) {
  const c10::IValue v = read_ivalue(archive, key, where);
  MIXPREC_CHECK_VALUE(v.isString(), where, ": '", key, "' must be a string, got ", v.tagKind());
  return v.toStringRef();
}

// An optional number: written only when set, so an absent key reads as unset.
inline std::optional<double> read_optional_double(torch::serialize::InputArchive& archive, const std::string& key,
                                                  const std::string& where) {
  c10::IValue v;
  if (!archive.try_read(key, v)) return std::nullopt;
  return ivalue_double(v, key, where);
}

inline void write_optional_double(torch::serialize::OutputArchive& archive, const std::string& key,
                                  const std::optional<double>& v) {
  if (v) archive.write(key, c10::IValue(*v));
}

// "<optimizer>: param_groups[i]", the prefix of every error about one param group.
inline std::string group_where(const std::string& name, size_t group) {
  return name + ": param_groups[" + std::to_string(group) + "]";
}

// "<name>: param_groups[g]: params[i]", for errors about one parameter (built only on failure
// when passed to TORCH_CHECK, whose message arguments are evaluated only then).
inline std::string param_where(const std::string& name, size_t group, size_t index) {
  return group_where(name, group) + ": params[" + std::to_string(index) + "]";
}

// The same for one of that parameter's state tensors: "... params[i] state['key']".
inline std::string state_where(const std::string& name, size_t group, size_t index, const std::string& key) {
  return param_where(name, group, index) + " state['" + key + "']";
}

// Whether `t` lays out its elements as `like` (same sizes) does: equal strides in every dimension
// of size > 1 (a size-1 dimension's stride is never used). With a dense `like`, `t` is dense too.
inline bool same_layout(const at::Tensor& t, const at::Tensor& like) {
  for (int64_t d = 0; d < like.dim(); ++d)
    if (like.size(d) > 1 && t.stride(d) != like.stride(d)) return false;
  return true;
}

// A copy of `t` (same dtype) on `like`'s device and in `like`'s layout, never sharing memory with
// `t`: state tensors follow their parameter's memory format (channels_last stays channels_last).
inline at::Tensor copy_in_layout_of(const at::Tensor& t, const at::Tensor& like) {
  return at::empty_like(like, like.options().dtype(t.scalar_type())).copy_(t);
}

// Hyper-parameter checks with the Python front's rules; errors name `where` and the field.
inline void check_finite_nonneg(const std::string& where, const char* name, double v) {
  MIXPREC_CHECK_VALUE(std::isfinite(v) && v >= 0, where, ": invalid ", name, " ", num(v),
                      "; it must be finite and >= 0");
}

inline void check_betas(const std::string& where, const std::tuple<double, double>& betas) {
  const double b1 = std::get<0>(betas), b2 = std::get<1>(betas);
  MIXPREC_CHECK_VALUE(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1, where, ": invalid betas (", num(b1), ", ", num(b2),
                      "); each must be in [0, 1)");
}

}  // namespace mixprec::detail::api
