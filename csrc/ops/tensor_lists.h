// Ops-tier helpers shared by every multi-tensor op: input validation with errors that name the
// op, the argument and the list index, and packing of tensor lists into kernel-tier groups.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/multi_tensor.h"
#include "ops/format.h"  // num() and shape(): every number in an error message goes through them

namespace mixprec::detail {

// The kernel dtype of a float tensor; `what` names it in the error ("op: arg[i]").
kernels::DType kernel_dtype(const at::Tensor& t, const std::string& what);

// Whether t's dtype is one kernel_dtype takes (float32, float16, bfloat16): where an op falls back
// to torch for the others (float64) instead of refusing them.
bool has_kernel_dtype(const at::Tensor& t);

// "mixprec::op: arg[i]" or "mixprec::op: arg" (index < 0), the prefix of every error message.
std::string arg_name(const char* op, const char* arg, int64_t index = -1);

// A one-element float32 tensor on `device` (found_inf, inv_scale, grad_scale, lr ...).
void check_scalar_tensor(const char* op, const char* arg, const at::Tensor& t, const at::Device& device,
                         at::ScalarType dtype = at::kFloat);

// One named list of an op's arguments. `written`: the op writes its tensors (false for grads),
// which matters to the overlap check. `may_be_params`: entry i may be params[i] itself (an fp32
// parameter is its own master), the one aliasing the kernels are written for.
struct NamedList {
  const char* name;
  at::TensorList tensors;
  bool written = true;
  bool may_be_params = false;
};

// The validated operands of one multi-tensor op: one group per combination of dtypes across
// the lists, plus every tensor in one list-less group (for per-tensor reductions).
struct PackedLists {
  std::vector<kernels::TensorGroup> groups;
  kernels::TensorGroup all;
  int64_t total_chunks = 0;
  int64_t num_tensors = 0;
};

// What pack_lists accepts beyond its common checks.
struct PackRules {
  // Any dense, non-overlapping layout (contiguous, channels_last, any permutation of dimensions)
  // that every tensor of an entry shares with lists[0]'s, so the kernels still walk each entry's
  // tensors together in storage order (element-wise ops and sums); else contiguous only.
  bool dense_layouts = false;
  // check_no_overlap: for ops that write some lists in place while reading the others.
  bool refuse_overlap = false;
};
// The fused optimizer ops: element-wise updates in place.
inline constexpr PackRules kInPlaceUpdate{/*dense_layouts=*/true, /*refuse_overlap=*/true};

// Checks that every list has lists[0]'s length, and every tensor is defined, on `device`,
// fp32/fp16/bf16, shaped like its counterpart in lists[0] and laid out as `rules` says; then
// packs them. Nothing is modified, so a failed check leaves every argument as it was.
PackedLists pack_lists(const char* op, const std::vector<NamedList>& lists, const at::Device& device,
                       PackRules rules = {});

// Refuses memory shared by a tensor the op writes and any other tensor of `lists` (the same
// tensor twice, overlapping views, one state tensor passed for two, a grad that is its param),
// naming both: torch's fused optimizers compute garbage there silently. A list that is lists[0]
// itself (a stand-in for an absent list, never touched) takes no part. O(n log n).
void check_no_overlap(const char* op, const std::vector<NamedList>& lists);

// One-element device tensors of an op (found_inf, a scale, a counter) and whether the op writes
// them. check_scalars_apart refuses one that shares memory with another scalar or with a tensor of
// `lists` where either is written (a found_inf flag that is an element of a gradient): the op
// would write one through the other. Dense list tensors are assumed (pack_lists checks them).
struct NamedScalar {
  const char* name;
  const at::Tensor* tensor;  // nullptr or undefined: absent
  bool written;
};
void check_scalars_apart(const char* op, const std::vector<NamedScalar>& scalars,
                         const std::vector<NamedList>& lists = {});

// A Meta kernel runs when any tensor of a call is on the meta device, and writes nothing: a call
// that mixes meta with real tensors (a meta grad beside CPU params) would be a step silently not
// taken. Refuses such a tensor, naming it.
void check_on_meta(const char* op, const char* arg, const at::Tensor& t, int64_t index = -1);
void check_on_meta(const char* op, const char* arg, at::TensorList tensors);

// The device an op runs on: that of `anchor` if defined, else of the first tensor of `list`.
at::Device op_device(const char* op, const NamedList& list, const c10::optional<at::Tensor>& anchor);

}  // namespace mixprec::detail
