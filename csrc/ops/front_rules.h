// Rules both fronts apply before they call an op, each written once here: the C++ front
// (csrc/api) calls these functions, the Python front asks the helper ops library.cpp makes of them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace mixprec::detail {

// "torch.float16": a dtype as Python prints it, so an error reads the same from either front.
std::string python_dtype(c10::ScalarType dtype);

// ---- remainder masters (master_weights="remainder" / master_remainder) -------------------------
// A remainder holds the low 16 bits of a bf16 param's fp32 master, so it exists only beside a
// bfloat16 param. `where` names param i with "{}" standing for i, in the front's own words
// ("param group 0 param {}", "param_groups[0]: params[{}]"); `option` is the front's name of the
// option. group: the first param that is not bfloat16 raises ValueError "<owner>: <option> needs
// bfloat16 params; <where i> is <dtype> (...)". Loaded (a checkpoint's remainder for each param):
// TypeError "<owner><where i> is an int16 remainder, which needs a bfloat16 parameter; ...", the op's
// class for the same mismatch (ops/optim_common.cpp).
void check_master_remainder(at::TensorList params, const std::string& owner, const std::string& option,
                            const std::string& where, bool loaded);

// The two forms of a master, for masters that change form outside a step (a checkpoint's master
// loaded into a group that keeps the other form, a switched option): the tensor twins of
// kernels/optim_common.h's split_master and rebuild_master, bit for bit, on any device and layout.
// master_split: (bf16 weight, int16 remainder) of an fp32 master, the weight nearest with ties
// toward zero; master_rebuild: the fp32 master a bf16 weight and its int16 remainder hold.
std::tuple<at::Tensor, at::Tensor> master_split(const at::Tensor& master);
at::Tensor master_rebuild(const at::Tensor& weight, const at::Tensor& remainder);

// ---- FP8 Linear eligibility -------------------------------------------------------------------
// torch._scaled_mm's tiles: every GEMM dimension (out and in features, the token count) a
// positive multiple of 16. Int: int64_t, or c10::SymInt in the op's checks under torch.compile.
constexpr int64_t kFp8Align = 16;
template <class Int> bool fp8_dim_fits(const Int& dim) { return dim > 0 && dim % kFp8Align == 0; }

// Why a Linear of this weight cannot run its GEMMs in FP8, or "" if it can. Without input, the
// conversion rule (a module's weight: in_features and out_features multiples of 16, a float
// dtype; the text both fronts' ineligibility() give); with input, the call rule: whether
// fp8_linear would take (input, weight) as they are (float dtypes, input's last dimension
// in_features, out/in features and the token count positive multiples of 16), else the fronts run
// plain linear.
std::string fp8_linear_ineligibility(const at::Tensor& weight, const at::Tensor* input = nullptr);

}  // namespace mixprec::detail
