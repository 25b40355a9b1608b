// The rules of ops/front_rules.h: remainder masters' bfloat16 params and the FP8 Linear's shapes,
// one implementation behind the C++ front and (through library.cpp's helper ops) the Python one.
#include "ops/front_rules.h"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include "ops/format.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {

std::string python_dtype(c10::ScalarType dtype) { return "torch." + std::string(c10::getDtypeNames(dtype).first); }

namespace {

// `where` with its "{}" replaced by i (as it is when it names one param, without "{}").
std::string position(const std::string& where, size_t i) {
  const auto at = where.find("{}");
  return at == std::string::npos ? where : where.substr(0, at) + num(i) + where.substr(at + 2);
}

}  // namespace

void check_master_remainder(at::TensorList params, const std::string& owner, const std::string& option,
                            const std::string& where, bool loaded) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.defined() || p.scalar_type() == at::kBFloat16) continue;
    if (loaded) {
      MIXPREC_CHECK_TYPE(false, owner, position(where, i),
                         " is an int16 remainder, which needs a bfloat16 parameter; the parameter is ",
                         python_dtype(p.scalar_type()));
    }
    MIXPREC_CHECK_VALUE(false, owner, ": ", option, " needs bfloat16 params; ", position(where, i), " is ",
                        python_dtype(p.scalar_type()), " (put it in a group of its own without ", option, ")");
  }
}

namespace {

// The low 16 bits of int64 values as int16 (two's complement: 0x8000..0xFFFF are negative).
at::Tensor low_half(const at::Tensor& x) {
  const at::Tensor b = x.bitwise_and(0xFFFF);
  return at::where(b.ge(0x8000), b - 0x10000, b).to(at::kShort);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> master_split(const at::Tensor& master) {
  MIXPREC_CHECK_TYPE(master.defined() && master.scalar_type() == at::kFloat,
                     "mixprec::master_split: master must be a float32 tensor, got ",
                     master.defined() ? python_dtype(master.scalar_type()) : std::string("an undefined tensor"));
  // Integer arithmetic on the bits (int64, so nothing overflows): split_master's expressions.
  const at::Tensor u = master.view(at::kInt).to(at::kLong).bitwise_and(0xFFFFFFFFLL);
  const at::Tensor is_nan = u.bitwise_and(0x7FFFFFFF).gt(0x7F800000);
  const at::Tensor high =
      at::where(is_nan, u.bitwise_right_shift(16).bitwise_or(0x40), (u + 0x7FFF).bitwise_right_shift(16));
  return {low_half(high).view(at::kBFloat16), low_half(u)};
}

at::Tensor master_rebuild(const at::Tensor& weight, const at::Tensor& remainder) {
  MIXPREC_CHECK_TYPE(weight.defined() && weight.scalar_type() == at::kBFloat16,
                     "mixprec::master_rebuild: weight must be a bfloat16 tensor, got ",
                     weight.defined() ? python_dtype(weight.scalar_type()) : std::string("an undefined tensor"));
  MIXPREC_CHECK_TYPE(remainder.defined() && remainder.scalar_type() == at::kShort,
                     "mixprec::master_rebuild: remainder must be an int16 tensor, got ",
                     remainder.defined() ? python_dtype(remainder.scalar_type()) : std::string("an undefined tensor"));
  MIXPREC_CHECK_VALUE(weight.sizes() == remainder.sizes(), "mixprec::master_rebuild: remainder has shape ",
                      shape(remainder.sizes()), " but weight has ", shape(weight.sizes()));
  const at::Tensor low = remainder.to(at::kLong).bitwise_and(0xFFFF);
  const at::Tensor high = weight.view(at::kShort).to(at::kLong).bitwise_and(0xFFFF) - low.gt(0x8000).to(at::kLong);
  const at::Tensor bits = high.bitwise_left_shift(16).bitwise_or(low).bitwise_and(0xFFFFFFFFLL);
  return at::where(bits.ge(1LL << 31), bits - (1LL << 32), bits).to(at::kInt).view(at::kFloat);
}

std::string fp8_linear_ineligibility(const at::Tensor& weight, const at::Tensor* input) {
  MIXPREC_CHECK_VALUE(weight.defined() && weight.dim() == 2, "mixprec::fp8_linear_ineligibility: weight must be ",
                      "a 2-D [out_features, in_features] tensor, got ",
                      weight.defined() ? shape(weight.sizes()) : std::string("an undefined tensor"));
  const int64_t n = weight.size(0), k = weight.size(1);
  if (input == nullptr) {
    // A module's conversion: its features, then its weight's dtype. Zero features pass here (0
    // is a multiple of 16); such a Linear runs plain linear at every call, as the call rule says.
    std::string bad;
    for (const auto& [name, v] : {std::pair<const char*, int64_t>{"in_features", k}, {"out_features", n}})
      if (v % kFp8Align) bad += (bad.empty() ? "" : ", ") + std::string(name) + "=" + num(v);
    if (!bad.empty()) return bad + " not a multiple of " + num(kFp8Align);
    if (!has_kernel_dtype(weight))
      return "weight dtype " + python_dtype(weight.scalar_type()) + " is not float32, float16 or bfloat16";
    return "";
  }
  const at::Tensor& x = *input;
  MIXPREC_CHECK_VALUE(x.defined(), "mixprec::fp8_linear_ineligibility: input is undefined");
  if (!has_kernel_dtype(x) || !has_kernel_dtype(weight))
    return "input dtype " + python_dtype(x.scalar_type()) + " or weight dtype " + python_dtype(weight.scalar_type()) +
           " is not float32, float16 or bfloat16";
  if (x.dim() == 0 || x.size(-1) != k) return "input's last dimension is not in_features = " + num(k);
  const int64_t tokens = k ? x.numel() / k : 0;
  if (!fp8_dim_fits(n) || !fp8_dim_fits(k) || !fp8_dim_fits(tokens))
    return "out_features " + num(n) + ", in_features " + num(k) + " and the token count " + num(tokens) +
           " are not all positive multiples of " + num(kFp8Align);
  return "";
}

}  // namespace mixprec::detail
