// The hyper-parameters of every fused optimizer op, declared once: each family's field list is
// the single source from which its op schema, its typed C++ call (mixprec/ops.h), the kernels'
// parameter block, the Python wrapper's defaults and the C++ options class are all made.
// Torch-free, so the kernel tier can include it.
//
// A field list is an X-macro: X(type, name, default) for every hyper-parameter, in schema order.
// type is double, bool or int64_t (schema "float", "bool", "int"); default is a C++ literal.
// Adding a hyper-parameter to a family = one X(...) line here plus its math in kernels/<family>.h
// (the kernels' parameter blocks hold these structs).
//
// Every family ends with the same two, MIXPREC_ROUNDING_ARGS: stochastic_rounding (bf16 params without masters take the
// update rounded stochastically, from a counter-based hash of (seed, step, tensor, element), so
// CPU and CUDA agree bit for bit; kernels/optim_common.h; it needs a step count, as it hashes
// it) and its seed.
#pragma once

#include <cstdint>

#include "export.h"  // beside this header: the kernel tier includes it by path, without csrc/include

// clang-format off
#define MIXPREC_ROUNDING_ARGS(X) X(bool, stochastic_rounding, false) X(int64_t, seed, 0)

#define MIXPREC_ADAM_ARGS(X)          \
  X(double, beta1, 0.9)               \
  X(double, beta2, 0.999)             \
  X(double, eps, 1e-8)                \
  X(double, weight_decay, 0.0)        \
  X(bool, adam_w_mode, true)          \
  X(bool, bias_correction, true)      \
  X(bool, maximize, false)            \
  MIXPREC_ROUNDING_ARGS(X)

#define MIXPREC_SGD_ARGS(X)           \
  X(double, momentum, 0.0)            \
  X(double, dampening, 0.0)           \
  X(double, weight_decay, 0.0)        \
  X(bool, nesterov, false)            \
  X(bool, wd_after_momentum, false)   \
  X(bool, maximize, false)            \
  MIXPREC_ROUNDING_ARGS(X)

#define MIXPREC_LAMB_ARGS(X)          \
  X(double, beta1, 0.9)               \
  X(double, beta2, 0.999)             \
  X(double, eps, 1e-6)                \
  X(double, weight_decay, 0.01)       \
  X(bool, bias_correction, true)      \
  X(bool, grad_averaging, true)       \
  X(bool, adam_w_mode, true)          \
  X(double, max_grad_norm, 1.0)       \
  X(bool, use_nvlamb, false)          \
  MIXPREC_ROUNDING_ARGS(X)

#define MIXPREC_ADAGRAD_ARGS(X)       \
  X(double, eps, 1e-10)               \
  X(double, weight_decay, 0.0)        \
  X(double, lr_decay, 0.0)            \
  X(bool, adagrad_w_mode, false)      \
  X(bool, maximize, false)            \
  MIXPREC_ROUNDING_ARGS(X)

#define MIXPREC_NOVOGRAD_ARGS(X)      \
  X(double, beta1, 0.9)               \
  X(double, beta2, 0.999)             \
  X(double, eps, 1e-8)                \
  X(double, weight_decay, 0.0)        \
  X(bool, bias_correction, true)      \
  X(bool, grad_averaging, true)       \
  X(bool, reg_inside_moment, false)   \
  X(double, norm_type, 2.0)           \
  X(bool, init_zero, false)           \
  MIXPREC_ROUNDING_ARGS(X)

// The rest of each op's declaration. Its tensors before the keyword arguments, in schema order:
// X(kind, name, alias), kind LIST (Tensor[]) or TENSOR, alias the schema's annotation (each is
// updated in place, grads too: they receive the unscaled gradient). After them every op takes the
// same step scalars (step_tensor; then keyword-only lr, the family's field list, step, lr_tensor,
// grad_scale, found_inf; mixprec::StepArgs in mixprec/ops.h), then its optional extra tensors:
// X(name, alias), alias "" for one only read.
// Adam's last two lists, empty unless its moments are 8-bit: the float32 scales of exp_avgs' int8
// and exp_avg_sqs' uint8 codes, one per 256 elements (kernels/quant8.h).
#define MIXPREC_ADAM_TENSORS(X)                                                               \
  X(LIST, params, "a!") X(LIST, grads, "g!") X(LIST, exp_avgs, "b!") X(LIST, exp_avg_sqs, "c!") \
  X(LIST, max_exp_avg_sqs, "d!") X(LIST, master_params, "e!") X(LIST, exp_avg_scales, "f!")       \
  X(LIST, exp_avg_sq_scales, "h!")
#define MIXPREC_ADAM_EXTRAS(X)

#define MIXPREC_SGD_TENSORS(X) \
  X(LIST, params, "a!") X(LIST, grads, "g!") X(LIST, momentum_buffers, "b!") X(LIST, master_params, "e!")
#define MIXPREC_SGD_EXTRAS(X)

#define MIXPREC_LAMB_TENSORS(X)                                                               \
  X(LIST, params, "a!") X(LIST, grads, "h!") X(LIST, exp_avgs, "b!") X(LIST, exp_avg_sqs, "c!") \
  X(LIST, master_params, "e!")
#define MIXPREC_LAMB_EXTRAS(X) X(global_grad_norm, "") X(local_norms, "g!") X(trust_norms, "")

#define MIXPREC_ADAGRAD_TENSORS(X) \
  X(LIST, params, "a!") X(LIST, grads, "g!") X(LIST, state_sums, "b!") X(LIST, master_params, "e!")
#define MIXPREC_ADAGRAD_EXTRAS(X)

#define MIXPREC_NOVOGRAD_TENSORS(X)                                                           \
  X(LIST, params, "a!") X(LIST, grads, "g!") X(LIST, exp_avgs, "b!") X(TENSOR, exp_avg_sq_norms, "c!") \
  X(LIST, master_params, "e!")
#define MIXPREC_NOVOGRAD_EXTRAS(X) X(grad_norms, "")

// Every family: F(op, Struct, MACRO): the op is mixprec::<op>_ (its validate-only twin
// mixprec::<op>_check), its hyper-parameters Struct##Args from MIXPREC_<MACRO>_ARGS.
#define MIXPREC_OPTIM_FAMILIES(F) \
  F(adam, Adam, ADAM) F(sgd, Sgd, SGD) F(lamb, Lamb, LAMB) F(adagrad, Adagrad, ADAGRAD) F(novograd, NovoGrad, NOVOGRAD)
// clang-format on

#define MIXPREC_ARGS_FIELD(type, name, default_value) type name = default_value;

namespace mixprec {

struct MIXPREC_API AdamArgs {
  MIXPREC_ADAM_ARGS(MIXPREC_ARGS_FIELD)
};
struct MIXPREC_API SgdArgs {
  MIXPREC_SGD_ARGS(MIXPREC_ARGS_FIELD)
};
struct MIXPREC_API LambArgs {
  MIXPREC_LAMB_ARGS(MIXPREC_ARGS_FIELD)
};
struct MIXPREC_API AdagradArgs {
  MIXPREC_ADAGRAD_ARGS(MIXPREC_ARGS_FIELD)
};
struct MIXPREC_API NovoGradArgs {
  MIXPREC_NOVOGRAD_ARGS(MIXPREC_ARGS_FIELD)
};

}  // namespace mixprec
