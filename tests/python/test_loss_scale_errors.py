# Tests of non_finite_check_and_unscale_'s argument checks on CPU and CUDA: every bad list length,
# dtype, shape, layout and device raises an error naming the op, the argument and the list index,
# and leaves every tensor as it was (no half-done unscale, no flag raised).
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import CHUNK, check_rejected, poisoned_like, random_tensor, scalar

OP = "non_finite_check_and_unscale_"


def _unscale_args(device, gen):
    # A NaN in grads[0] and a non-unit inv_scale: any work done before the error would show.
    grads = [random_tensor(5, torch.float32, device, gen), random_tensor(CHUNK + 3, torch.float16, device, gen),
             random_tensor(7, torch.bfloat16, device, gen), random_tensor((4, 3), torch.float32, device, gen)]
    grads[0][0] = math.nan
    out = [poisoned_like(g, torch.float32) for g in grads]
    return dict(grads=grads, found_inf=scalar(0.0, device), inv_scale=scalar(0.37, device), out=out,
                per_tensor_found=torch.zeros(4, device=device))


def _nc(shape, dtype, device):  # a non-contiguous tensor of `shape`
    return torch.ones(tuple(reversed(shape)), dtype=dtype, device=device).t()


def _set(key, i, make):
    def f(a, device):
        a[key] = list(a[key])
        a[key][i] = make(a[key][i], device)
    return f


def _put(key, make):
    def f(a, device):
        a[key] = make(a, device)
    return f


# (mutation of the valid arguments, exception type, argument named, index named)
UNSCALE_BAD = {
    "out_shorter": (_put("out", lambda a, d: a["out"][:3]), ValueError, "out", None),
    "out_longer": (_put("out", lambda a, d: a["out"] + [torch.ones(1, device=d)]), ValueError, "out", None),
    "grads_float64": (_set("grads", 2, lambda t, d: t.double()), TypeError, "grads", 2),
    "grads_int32": (_set("grads", 2, lambda t, d: torch.ones(7, dtype=torch.int32, device=d)), TypeError, "grads", 2),
    "grads_non_contiguous": (_set("grads", 3, lambda t, d: _nc((4, 3), torch.float32, d)), RuntimeError, "grads", 3),
    "out_float64": (_set("out", 1, lambda t, d: t.double()), TypeError, "out", 1),
    "out_int64": (_set("out", 1, lambda t, d: t.long()), TypeError, "out", 1),
    "out_wrong_shape": (_set("out", 2, lambda t, d: torch.ones(8, device=d)), ValueError, "out", 2),
    "out_transposed_shape": (_set("out", 3, lambda t, d: torch.ones(3, 4, device=d)), ValueError, "out", 3),
    "out_non_contiguous": (_set("out", 3, lambda t, d: _nc((4, 3), torch.float32, d)), RuntimeError, "out", 3),
    "found_inf_two_elements": (_put("found_inf", lambda a, d: torch.zeros(2, device=d)), ValueError, "found_inf", None),
    "found_inf_float64": (_put("found_inf", lambda a, d: scalar(0.0, d, torch.float64)), TypeError, "found_inf", None),
    "found_inf_int32": (_put("found_inf", lambda a, d: scalar(0, d, torch.int32)), TypeError, "found_inf", None),
    "inv_scale_half": (_put("inv_scale", lambda a, d: scalar(0.5, d, torch.float16)), TypeError, "inv_scale", None),
    "inv_scale_empty": (_put("inv_scale", lambda a, d: torch.ones(0, device=d)), ValueError, "inv_scale", None),
    "inv_scale_two_elements": (_put("inv_scale", lambda a, d: torch.ones(2, device=d)), ValueError, "inv_scale", None),
    "per_tensor_found_short": (_put("per_tensor_found", lambda a, d: torch.zeros(3, device=d)), ValueError,
                               "per_tensor_found", None),
    "per_tensor_found_2d": (_put("per_tensor_found", lambda a, d: torch.zeros(4, 1, device=d)), ValueError,
                            "per_tensor_found", None),
    "per_tensor_found_int32": (_put("per_tensor_found", lambda a, d: torch.zeros(4, dtype=torch.int32, device=d)),
                               TypeError, "per_tensor_found", None),
    "per_tensor_found_strided": (_put("per_tensor_found", lambda a, d: torch.zeros(8, device=d)[::2]), ValueError,
                                 "per_tensor_found", None),
}
UNSCALE_BAD_CUDA = {
    "grads_on_cpu": (_set("grads", 2, lambda t, d: t.cpu()), RuntimeError, "grads", 2),
    "out_on_cpu": (_set("out", 1, lambda t, d: t.cpu()), RuntimeError, "out", 1),
    "inv_scale_on_cpu": (_put("inv_scale", lambda a, d: a["inv_scale"].cpu()), RuntimeError, "inv_scale", None),
    "per_tensor_found_on_cpu": (_put("per_tensor_found", lambda a, d: a["per_tensor_found"].cpu()), RuntimeError,
                                "per_tensor_found", None),
}


def _check_unscale_rejects(device, gen, case, mode):
    mutate, exc, arg, index = case
    a = _unscale_args(device, gen)
    if mode == "check":
        a["inv_scale"] = None
    if mode != "out":
        a["out"] = []
    mutate(a, device)
    every = a["grads"] + a["out"] + [a["found_inf"], a["inv_scale"], a["per_tensor_found"]]
    check_rejected(lambda: mixprec.non_finite_check_and_unscale_(**a), every, exc, OP, arg, index, device)


@pytest.mark.parametrize("case", sorted(UNSCALE_BAD))
def test_unscale_rejects_bad_inputs_and_modifies_nothing(device, case, gen):
    mode = "out" if case.startswith("out") else "in_place"
    _check_unscale_rejects(device, gen, UNSCALE_BAD[case], mode)


@pytest.mark.parametrize("case", ["grads_float64", "grads_int32", "grads_non_contiguous", "per_tensor_found_short"])
def test_check_only_rejects_bad_inputs(device, case, gen):
    _check_unscale_rejects(device, gen, UNSCALE_BAD[case], "check")


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(UNSCALE_BAD_CUDA))
def test_unscale_rejects_wrong_device(case, gen):
    mode = "out" if case.startswith("out") else "in_place"
    _check_unscale_rejects("cuda", gen, UNSCALE_BAD_CUDA[case], mode)


def test_nonempty_out_with_empty_grads_is_rejected(device):
    found = scalar(0.0, device)
    out = [torch.ones(3, device=device)]
    check_rejected(lambda: mixprec.non_finite_check_and_unscale_([], found, scalar(2.0, device), out),
                   [found] + out, ValueError, OP, "out", None, device)
