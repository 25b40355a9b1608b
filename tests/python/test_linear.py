# Tests of mixprec.linear_weight_bias_grad (a Linear's weight and bias gradients together: on CUDA
# in fp16/bf16 one cuBLASLt GEMM with the bias sum in its epilogue, elsewhere torch's mm and
# linear_bias_grad) against float64 references: GPT-2's shapes and odd ones, no rows, unaligned
# operands, inf/NaN, determinism, poisoned outputs, bad inputs, opcheck and CUDA-graph capture;
# and of mixprec.linear (torch's linear with linear_bias_grad in its backward): equal to torch's
# forward and GEMM gradients, gradcheck, opcheck, frozen parameters and bad inputs.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import FLOAT_DTYPES, check_rejected, random_tensor, sync

pytestmark = pytest.mark.usefixtures("poisoned_empty")  # an unwritten output element reads NaN

OP = "linear_weight_bias_grad"
# (rows, out_features, in_features): odd sizes that break every vector and tile (the composite on
# CUDA), 16-byte aligned ones (cuBLASLt on CUDA in fp16/bf16), one row, and on CUDA GPT-2's four
# Linears on large (4096 tokens) and a small one with 16384 rows.
SHAPES = [(1, 9, 7), (33, 9, 7), (257, 129, 65), (1025, 3, 1), (1, 8, 16), (33, 24, 40), (1025, 8, 8), (257, 136, 64)]
CUDA_SHAPES = [(4096, 3840, 1280), (4096, 1280, 1280), (4096, 5120, 1280), (4096, 1280, 5120), (16384, 768, 3072)]


def fp32_accumulation_bound(terms: torch.Tensor, ref: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """|error| of a k-term fp32 sum rounded once to `dtype`: k * eps32 * sum|terms| + eps(dtype) * |ref|."""
    return k * 2.0**-23 * terms + torch.finfo(dtype).eps * ref.abs()


def check_grads(got: tuple[torch.Tensor, torch.Tensor], grad: torch.Tensor, input: torch.Tensor, what: str) -> None:
    """Both outputs (any device) against float64 products and sums of grad and input (any device)."""
    grad_weight, grad_bias = (t.cpu() for t in got)
    g, x = grad.cpu().double(), input.cpu().double()
    rows, out_features = g.shape
    assert grad_weight.dtype == grad.dtype and grad_weight.shape == (out_features, x.shape[1]), what
    assert grad_bias.dtype == grad.dtype and grad_bias.shape == (out_features,), what
    ref_w, ref_b = g.t() @ x, g.sum(0)
    bound_w = fp32_accumulation_bound(g.abs().t() @ x.abs(), ref_w, rows, grad.dtype)
    bound_b = fp32_accumulation_bound(g.abs().sum(0), ref_b, rows, grad.dtype)
    for name, out, ref, bound in (("grad_weight", grad_weight, ref_w, bound_w), ("grad_bias", grad_bias, ref_b, bound_b)):
        if grad.dtype == torch.float32:  # torch's fp32 mm may use TF32 (10-bit mantissa products)
            bound = bound + rows * 2.0**-10 * (g.abs().t() @ x.abs() if name == "grad_weight" else 0)
        err = (out.double() - ref).abs()
        assert bool((err <= bound + 1e-30).all()), f"{what} {name}: max error {float(err.max()):.3g}"


def grads_for(rows, out_features, in_features, dtype, device, gen):
    return (random_tensor((rows, out_features), dtype, device, gen),
            random_tensor((rows, in_features), dtype, device, gen))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_both_gradients_within_fp32_accumulation(device, dtype, shape, gen):
    grad, input = grads_for(*shape, dtype, device, gen)
    check_grads(mixprec.linear_weight_bias_grad(grad, input), grad, input, f"{dtype} {shape}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_gpt2_shapes_on_cuda(dtype, shape, gen):
    grad, input = grads_for(*shape, dtype, "cuda", gen)
    check_grads(mixprec.linear_weight_bias_grad(grad, input), grad, input, f"{dtype} {shape}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_runs_one_gemm_without_a_separate_bias_pass(dtype, gen):
    # The point of the op: the composite's fallback is correct too, so only the kernels show it.
    grad, input = grads_for(4096, 1280, 640, dtype, "cuda", gen)
    mixprec.linear_weight_bias_grad(grad, input)  # warm-up: cuBLASLt's first call loads its kernels
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        mixprec.linear_weight_bias_grad(grad, input)
        sync("cuda")
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "no CUDA kernel recorded"
    # Neither mixprec's bias kernels nor torch's sum (cuBLAS's own split-K reduction may appear).
    assert not [k for k in kernels if "bias_grad" in k or "at::native::reduce_kernel" in k], kernels


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_no_rows_gives_zero_gradients(device, dtype):
    grad, input = torch.empty(0, 5, dtype=dtype, device=device), torch.empty(0, 3, dtype=dtype, device=device)
    grad_weight, grad_bias = mixprec.linear_weight_bias_grad(grad, input)
    assert torch.equal(grad_weight.cpu(), torch.zeros(5, 3, dtype=dtype))
    assert torch.equal(grad_bias.cpu(), torch.zeros(5, dtype=dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unaligned_operands(device, dtype, gen):
    # Views at an odd element offset: no 16-byte (let alone cuBLASLt's 256-byte) alignment.
    rows, out_features, in_features = 65, 24, 40
    grad = random_tensor(rows * out_features + 1, dtype, device, gen)[1:].view(rows, out_features)
    input = random_tensor(rows * in_features + 1, dtype, device, gen)[1:].view(rows, in_features)
    check_grads(mixprec.linear_weight_bias_grad(grad, input), grad, input, f"{dtype} unaligned")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_is_deterministic(device, dtype, gen):
    grad, input = grads_for(1031, 257, 129, dtype, device, gen)
    first = mixprec.linear_weight_bias_grad(grad, input)
    for _ in range(3):
        again = mixprec.linear_weight_bias_grad(grad, input)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_grad_reaches_its_row_of_grad_weight_and_its_bias_only(device, value, gen):
    grad, input = grads_for(300, 40, 24, torch.float16, device, gen)
    grad[177, 13] = value
    grad_weight, grad_bias = (t.cpu() for t in mixprec.linear_weight_bias_grad(grad, input))
    assert not torch.isfinite(grad_weight[13]).any()  # inf times inputs of both signs: inf and -inf, or NaN
    if math.isnan(value):
        assert math.isnan(grad_bias[13])
    else:
        assert grad_bias[13] == value
    assert torch.isfinite(torch.cat([grad_weight[:13], grad_weight[14:]])).all()
    assert torch.isfinite(torch.cat([grad_bias[:13], grad_bias[14:]])).all()


def test_bad_inputs_are_named(device):
    grad, input = torch.zeros(4, 3, device=device), torch.zeros(4, 5, device=device)
    fn = mixprec.linear_weight_bias_grad
    check_rejected(lambda: fn(grad, input.double()), [grad, input], TypeError, OP, "input")
    check_rejected(lambda: fn(grad.to(torch.int32), input), [grad, input], TypeError, OP, "grad")
    check_rejected(lambda: fn(grad, torch.zeros(3, 5, device=device)), [grad, input], ValueError, OP, "input")
    check_rejected(lambda: fn(grad.view(12), input), [grad, input], ValueError, OP, "grad")
    check_rejected(lambda: fn(grad, input.view(2, 2, 5)), [grad, input], ValueError, OP, "input")
    check_rejected(lambda: fn(torch.zeros(3, 4, device=device).t(), input), [grad, input], RuntimeError, OP, "grad")


@pytest.mark.cuda
def test_inputs_on_two_devices_are_named():
    grad, input = torch.zeros(4, 3, device="cuda"), torch.zeros(4, 5)
    check_rejected(lambda: mixprec.linear_weight_bias_grad(grad, input), [grad, input], RuntimeError, OP, "input")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_opcheck(device, dtype, gen):
    grad, input = grads_for(67, 33, 17, dtype, device, gen)
    torch.library.opcheck(torch.ops.mixprec.linear_weight_bias_grad.default, (grad, input))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_captures_in_a_cuda_graph(dtype, gen):
    grad, input = grads_for(4096, 1280, 640, dtype, "cuda", gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        mixprec.linear_weight_bias_grad(grad, input)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mixprec.linear_weight_bias_grad(grad, input)
    grad.mul_(2)
    graph.replay()
    sync("cuda")
    eager = mixprec.linear_weight_bias_grad(grad, input)
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


# ---- mixprec.linear: torch's linear whose backward sums the bias gradient with linear_bias_grad -----


def _linear_grads(fn, x, w, b, dy):
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    b = b.detach().requires_grad_(True) if b is not None else None
    y = fn(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(7,), (5, 7), (3, 33, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_equals_torch_but_for_the_bias_sum(device, dtype, shape, with_bias, gen):
    x = random_tensor(shape, dtype, device, gen)
    w = random_tensor((9, 7), dtype, device, gen)
    b = random_tensor((9,), dtype, device, gen) if with_bias else None
    dy = random_tensor(shape[:-1] + (9,), dtype, device, gen)
    got = _linear_grads(mixprec.linear, x, w, b, dy)
    want = _linear_grads(torch.nn.functional.linear, x, w, b, dy)
    # The forward and the input gradient are the same ATen calls as torch's.
    assert torch.equal(got[0], want[0]), "output differs from torch's"
    assert torch.equal(got[1], want[1]), "grad input differs from torch's"
    assert torch.equal(got[2], want[2]), "grad weight differs from torch's"  # torch's mm too
    if with_bias:  # linear_bias_grad's fp32 sum
        assert torch.equal(got[3], mixprec.linear_bias_grad(dy.reshape(-1, 9)))
        check_grads((got[2], got[3]), dy.reshape(-1, 9), x.reshape(-1, 7), f"{dtype} {shape}")
    else:
        assert got[3] is None


def test_linear_gradcheck_in_float64(gen):
    x = torch.randn(4, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(mixprec.linear, (x, w, b))


def test_linear_skips_grads_no_one_needs(device, gen):
    x = random_tensor((8, 4), torch.float32, device, gen)  # no requires_grad: an input batch
    w = random_tensor((3, 4), torch.float32, device, gen).requires_grad_(True)
    b = random_tensor((3,), torch.float32, device, gen)  # frozen bias
    mixprec.linear(x, w, b).sum().backward()
    assert w.grad is not None and x.grad is None and b.grad is None
    w.requires_grad_(False)
    b.requires_grad_(True)  # a trainable bias on a frozen weight: the bias sum alone
    dy = random_tensor((8, 3), torch.float32, device, gen)
    mixprec.linear(x, w, b).backward(dy)
    assert torch.equal(b.grad, mixprec.linear_bias_grad(dy))


def test_linear_bad_inputs_are_named(device):
    x, w, b = torch.zeros(2, 4, device=device), torch.zeros(3, 4, device=device), torch.zeros(3, device=device)
    check_rejected(lambda: mixprec.linear(x, w.view(12)), [x, w], ValueError, "linear", "weight")
    check_rejected(lambda: mixprec.linear(torch.zeros(2, 5, device=device), w), [w], ValueError, "linear", "input")
    check_rejected(lambda: mixprec.linear(x, w, b[:2]), [x, w, b], ValueError, "linear", "bias")


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_opcheck(device, with_bias, gen):
    x = random_tensor((5, 3, 7), torch.float32, device, gen).requires_grad_(True)
    w = random_tensor((9, 7), torch.float32, device, gen).requires_grad_(True)
    b = random_tensor((9,), torch.float32, device, gen).requires_grad_(True) if with_bias else None
    torch.library.opcheck(torch.ops.mixprec.linear.default, (x, w, b))
