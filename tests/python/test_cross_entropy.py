# Tests of the fused cross-entropy (mixprec.cross_entropy and its two ops) on CPU and CUDA against
# float64 references: vocabularies at vector/tile boundaries, ignored rows, inf/NaN, reductions,
# autograd, bad inputs, opcheck and torch.compile.
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mixprec
from conftest import FLOAT_DTYPES, assert_rel_err, check_rejected, peer_bound, random_tensor, rel_err, sync

FWD, BWD = "cross_entropy_forward", "cross_entropy_backward"
TOL = 1e-5  # fp32 math against float64 of the same (rounded) logits
# Around 8- and 16-lane vectors, the CPU's 512-logit tiles and CUDA's 512-thread blocks.
VOCABS = (1, 7, 8, 9, 511, 513, 1023, 1025, 4097)
SCALE = 30.0  # logits spread like a trained LM's: most softmax mass on a few classes


pytestmark = pytest.mark.usefixtures("poisoned_empty")


def make_inputs(n, v, dtype, device, gen, scale=SCALE, ignore_index=-100, ignore_frac=0.0):
    """Random logits [n, v] (random row offsets too, so lse is not near 0) and targets, a fraction
    of them ignore_index."""
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
    logits += torch.randn(n, 1, generator=gen, dtype=torch.float64) * scale
    target = torch.randint(0, v, (n,), generator=gen)
    if ignore_frac > 0:
        target[torch.rand(n, generator=gen) < ignore_frac] = ignore_index
    return logits.to(dtype).to(device), target.to(device)


def reference(logits, target, ignore_index=-100):
    """float64 (losses, lse) of the logits as stored."""
    x = logits.detach().cpu().double()
    t = target.cpu()
    lse = torch.logsumexp(x, dim=1)
    keep = t != ignore_index
    picked = x.gather(1, torch.where(keep, t, 0).unsqueeze(1)).squeeze(1)
    return torch.where(keep, lse - picked, 0.0), lse


def reference_grad(logits, target, grad_losses, ignore_index=-100):
    x = logits.detach().cpu().double()
    t = target.cpu()
    keep = t != ignore_index
    onehot = F.one_hot(torch.where(keep, t, 0), x.shape[1]).bool()
    p = torch.softmax(x, dim=1)
    # p_t - 1 as minus the other classes' sum: when the target dominates, 1 - p_t is below even
    # float64's resolution (1e-17 seen), and p_t - 1 would be a wrong 0.
    others = p.masked_fill(onehot, 0.0)
    g = grad_losses.cpu().double().unsqueeze(1) * torch.where(onehot, -others.sum(1, keepdim=True), others)
    return torch.where(keep.unsqueeze(1), g, 0.0)


def peer_grad(logits, target, grad_losses, ignore_index=-100):
    """What plain PyTorch gives in the logits' dtype: fp32 upcast, autograd, gradient cast back."""
    x = logits.detach().float().requires_grad_(True)
    F.cross_entropy(x, target, ignore_index=ignore_index, reduction="none").backward(grad_losses)
    return x.grad.to(logits.dtype)


def grad_bound(logits, peer, ref, lse) -> float:
    """fp16/bf16: docs/architecture.md's 2x torch's error in that dtype. fp32: TOL plus what the backward's
    one input of its own costs: exp(x - lse) sees lse rounded to fp32, a relative error of up to
    |lse| * 2^-24 in every probability (torch keeps x - max and the log-sum apart instead)."""
    if logits.dtype != torch.float32:
        return peer_bound(logits.dtype, peer, ref)
    lse_rounding = float(lse.abs().max()) * 2.0**-24 if lse.numel() else 0.0
    return TOL + 2 * lse_rounding


def run_ops(logits, target, grad_losses, ignore_index=-100):
    losses, lse = mixprec._cross_entropy.cross_entropy_forward(logits, target, ignore_index)
    grad = mixprec._cross_entropy.cross_entropy_backward(grad_losses, logits, target, lse, ignore_index)
    sync(logits.device)
    return losses, lse, grad


def check_against_float64(logits, target, ignore_index=-100, gen=None, what=""):
    n = logits.shape[0]
    g = random_tensor(n, torch.float32, logits.device, gen) if gen is not None else torch.ones(n, device=logits.device)
    losses, lse, grad = run_ops(logits, target, g, ignore_index)
    assert losses.dtype == lse.dtype == torch.float32 and losses.shape == lse.shape == (n,)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape and grad.is_contiguous()
    ref_losses, ref_lse = reference(logits, target, ignore_index)
    # A row whose target dominates has a loss near log(1 + tiny), which fp32 cannot resolve (torch
    # neither): the losses are held to TOL or to twice torch's fp32 error, whichever is looser.
    peer_losses = F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")
    assert_rel_err(losses, ref_losses, max(TOL, 2 * rel_err(peer_losses, ref_losses)), f"{what} losses")
    assert_rel_err(lse, ref_lse, TOL, f"{what} lse")
    ref = reference_grad(logits, target, g, ignore_index)
    bound = grad_bound(logits, peer_grad(logits, target, g, ignore_index), ref, lse)
    assert_rel_err(grad, ref, bound, f"{what} grad ({logits.dtype}, bound {bound:.2e})")
    ignored = (target == ignore_index).cpu()
    assert bool((losses.cpu()[ignored] == 0).all()), f"{what}: ignored rows have a loss"
    assert bool((grad.cpu()[ignored] == 0).all()), f"{what}: ignored rows have a gradient"
    return losses, lse, grad


# ---- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_matches_float64(device, dtype, v, gen):
    for n in (1, 37):
        logits, target = make_inputs(n, v, dtype, device, gen, ignore_frac=0.2)
        check_against_float64(logits, target, gen=gen, what=f"[{n}, {v}]")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_gpt2_vocabulary(device, dtype, gen):
    logits, target = make_inputs(5, 50304, dtype, device, gen)
    check_against_float64(logits, target, gen=gen, what="[5, 50304]")


@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0])
def test_magnitudes(device, scale, gen):
    logits, target = make_inputs(16, 1000, torch.bfloat16, device, gen, scale=scale)
    check_against_float64(logits, target, gen=gen, what=f"scale {scale}")


@pytest.mark.parametrize("ignore_index", [-100, 0, 5])
def test_ignore_index(device, ignore_index, gen):
    logits, target = make_inputs(64, 9, torch.float16, device, gen, ignore_index=ignore_index, ignore_frac=0.5)
    assert bool((target == ignore_index).any())
    check_against_float64(logits, target, ignore_index, gen, f"ignore_index {ignore_index}")


def test_empty_batch_and_single_class(device, gen):
    for dtype in FLOAT_DTYPES:
        losses, lse, grad = run_ops(torch.empty(0, 11, dtype=dtype, device=device),
                                    torch.empty(0, dtype=torch.long, device=device),
                                    torch.empty(0, device=device))
        assert losses.shape == lse.shape == (0,) and grad.shape == (0, 11) and grad.dtype == dtype
        logits, target = make_inputs(9, 1, dtype, device, gen)
        losses, lse, grad = check_against_float64(logits, target, gen=gen, what="V=1")
        assert bool((losses == 0).all()) and bool((grad == 0).all())  # one class: certain, exactly


def test_many_rows_spread_over_threads(device, gen):
    logits, target = make_inputs(3000, 33, torch.bfloat16, device, gen, ignore_frac=0.1)
    check_against_float64(logits, target, gen=gen, what="[3000, 33]")


@pytest.mark.skipif(os.environ.get("MIXPREC_CPU_SIMD") == "0", reason="this run is on the portable path already")
def test_portable_cpu_tile_conversions():
    # fp16/bf16 tiles go through AVX2/F16C when the CPU has them; MIXPREC_CPU_SIMD=0 forces the
    # portable conversions (aarch64, older x86-64), chosen once per process: rerun in a fresh one.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
           "-k", "cpu and (matches_float64 or gpt2 or nan_logit or infinite_logits)"]
    r = subprocess.run(cmd, env=dict(os.environ, MIXPREC_CPU_SIMD="0"), cwd=os.path.dirname(__file__),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, f"portable path failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"


# ---- inf and NaN ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_nan_logit_makes_that_row_nan(device, dtype, where, gen):
    v = 1025
    logits, target = make_inputs(6, v, dtype, device, gen)
    col = {"first": 0, "last": v - 1, "random": int(torch.randint(0, v, (1,), generator=gen))}[where]
    logits[2, col] = math.nan
    losses, lse, grad = run_ops(logits, target, torch.ones(6, device=device))
    assert math.isnan(losses[2].item()) and math.isnan(lse[2].item()), "a NaN logit must never give a finite loss"
    assert bool(grad[2].isnan().all()), "the NaN row's gradient must be NaN"
    rest = torch.tensor([0, 1, 3, 4, 5])
    ref_losses, _ = reference(logits.cpu()[rest], target.cpu()[rest])
    assert_rel_err(losses.cpu()[rest], ref_losses, TOL, "rows without NaN")
    assert not bool(grad.cpu()[rest].isnan().any())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_infinite_logits(device, dtype, gen):
    v = 1030
    logits, target = make_inputs(4, v, dtype, device, gen)
    target[:] = torch.tensor([3, 4, 5, 6])
    logits[0, 0] = -math.inf      # -inf beside finite logits: a class with probability 0, loss finite
    logits[0, v - 1] = -math.inf
    logits[1, ::3] = -math.inf    # many, but not the target
    logits[2, 7] = math.inf       # +inf: inf - inf, NaN as in torch's log_softmax
    logits[3, 6] = -math.inf      # the target itself at -inf: loss +inf, as in torch
    g = torch.ones(4, device=device)
    losses, lse, grad = run_ops(logits, target, g)
    peer = F.cross_entropy(logits.float(), target, reduction="none")
    ref_losses, _ = reference(logits[:2], target[:2])
    assert_rel_err(losses[:2], ref_losses, TOL, "rows with -inf logits")
    assert_rel_err(grad[:2], reference_grad(logits[:2], target[:2], g[:2]),
                   peer_bound(dtype, peer_grad(logits[:2], target[:2], g[:2]), reference_grad(logits[:2], target[:2], g[:2])),
                   "gradient of rows with -inf logits")
    assert bool((grad[1, ::3] == 0).all()), "a -inf logit has probability 0: its gradient is 0"
    assert math.isnan(losses[2].item()) and math.isnan(peer[2].item())
    assert losses[3].item() == math.inf == peer[3].item()


# ---- the Python function: shapes, reductions, autograd ----------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cross_entropy_matches_torch(device, dtype, reduction, gen):
    b, t, v = 3, 17, 257
    logits, target = make_inputs(b * t, v, dtype, device, gen, ignore_frac=0.2)
    logits, target = logits.view(b, t, v).requires_grad_(True), target.view(b, t)
    loss = mixprec.cross_entropy(logits, target, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == (() if reduction != "none" else (b, t))
    x64 = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(x64.view(-1, v), target.view(-1), reduction=reduction)
    ref = ref.view(b, t) if reduction == "none" else ref
    assert_rel_err(loss, ref, TOL, f"{reduction} loss")
    upstream = random_tensor(loss.shape, torch.float32, device, gen)
    loss.backward(upstream)
    ref.backward(upstream.double())
    x32 = logits.detach().float().requires_grad_(True)
    peer = F.cross_entropy(x32.view(-1, v), target.view(-1), reduction=reduction)
    (peer.view(b, t) if reduction == "none" else peer).backward(upstream)
    bound = peer_bound(dtype, x32.grad.to(dtype), x64.grad)
    if dtype == torch.float32:  # see grad_bound: lse's rounding
        lse_max = float(torch.logsumexp(x64.detach(), dim=-1).abs().max())
        bound = max(TOL, 2 * rel_err(x32.grad, x64.grad)) + 2 * lse_max * 2.0**-24
    assert logits.grad.dtype == dtype
    assert_rel_err(logits.grad, x64.grad, bound, f"{reduction} grad")


def test_cross_entropy_all_ignored_mean_is_nan_like_torch(device, gen):
    logits, _ = make_inputs(4, 5, torch.float32, device, gen)
    target = torch.full((4,), -100, device=device)
    assert math.isnan(mixprec.cross_entropy(logits, target).item())
    assert math.isnan(F.cross_entropy(logits, target).item())


def test_lse_is_not_differentiable(device, gen):
    logits, target = make_inputs(4, 5, torch.float32, device, gen)
    losses, lse = torch.ops.mixprec.cross_entropy_forward(logits.requires_grad_(True), target)
    assert losses.requires_grad and not lse.requires_grad


# ---- bad inputs ---------------------------------------------------------------------------------


def _bad_forward_cases(device):
    x = torch.randn(4, 6, device=device)
    t = torch.randint(0, 6, (4,), device=device)
    return {
        "logits float64": (x.double(), t, TypeError, "logits"),
        "logits int": (x.long(), t, TypeError, "logits"),
        "logits 1-D": (x[0], t[:1], ValueError, "logits"),
        "logits 3-D": (x.view(2, 2, 6), t, ValueError, "logits"),
        "logits no classes": (x[:, :0], t, ValueError, "logits"),
        "logits non-contiguous": (torch.randn(6, 4, device=device).t(), t, RuntimeError, "logits"),
        "target int32": (x, t.int(), TypeError, "target"),
        "target float": (x, t.float(), TypeError, "target"),
        "target 2-D": (x, t.view(2, 2), ValueError, "target"),
        "target short": (x, t[:3], ValueError, "target"),
        "target non-contiguous": (x, torch.randint(0, 6, (4, 2), device=device)[:, 0], RuntimeError, "target"),
    }


@pytest.mark.parametrize("case", sorted(_bad_forward_cases("cpu")))
def test_bad_forward_inputs_are_rejected(device, case):
    logits, target, exc, arg = _bad_forward_cases(device)[case]
    op = torch.ops.mixprec.cross_entropy_forward
    check_rejected(lambda: op(logits, target), [logits, target], exc, FWD, arg, None, device)
    lse = torch.zeros(logits.shape[0] if logits.dim() else 1, device=device)
    g = torch.ones_like(lse)
    check_rejected(lambda: torch.ops.mixprec.cross_entropy_backward(g, logits, target, lse),
                   [g, logits, target, lse], exc, BWD, arg, None, device)


@pytest.mark.parametrize("arg", ["grad_losses", "lse"])
def test_bad_backward_vectors_are_rejected(device, arg):
    x = torch.randn(4, 6, device=device)
    t = torch.randint(0, 6, (4,), device=device)
    good = torch.ones(4, device=device)
    op = torch.ops.mixprec.cross_entropy_backward
    for bad, exc in ((good.half(), TypeError), (torch.ones(5, device=device), ValueError),
                     (torch.ones(8, device=device)[::2], RuntimeError)):
        args = {"grad_losses": good, "lse": good, arg: bad}
        check_rejected(lambda: op(args["grad_losses"], x, t, args["lse"]), [x, t, bad], exc, BWD, arg, None, device)


@pytest.mark.parametrize("value", [6, 7, -1, -101])
def test_target_out_of_range_is_rejected_on_cpu(value):
    x = torch.randn(4, 6)
    t = torch.tensor([0, 5, value, 1])
    check_rejected(lambda: torch.ops.mixprec.cross_entropy_forward(x, t), [x, t], IndexError, FWD, "target", 2)
    check_rejected(lambda: torch.ops.mixprec.cross_entropy_backward(torch.ones(4), x, t, torch.zeros(4)), [x, t],
                   IndexError, BWD, "target", 2)
    check_rejected(lambda: mixprec.cross_entropy(x, t), [x, t], IndexError, FWD, "target", 2)


@pytest.mark.cuda
def test_target_out_of_range_poisons_the_row_on_cuda(gen):
    logits, target = make_inputs(4, 6, torch.bfloat16, "cuda", gen)
    target[1], target[3] = 6, -1
    losses, lse, grad = run_ops(logits, target, torch.ones(4, device="cuda"))
    assert math.isnan(losses[1].item()) and math.isnan(losses[3].item())
    assert bool(grad[1].isnan().all()) and bool(grad[3].isnan().all())
    keep = torch.tensor([0, 2])
    assert_rel_err(losses.cpu()[keep], reference(logits.cpu()[keep], target.cpu()[keep])[0], TOL, "good rows")
    assert_rel_err(lse, reference(logits, torch.zeros_like(target))[1], TOL, "lse of every row")


def test_bad_arguments_to_the_python_function(device):
    x = torch.randn(2, 3, 5, device=device)
    with pytest.raises(ValueError, match="mixprec.cross_entropy: reduction"):
        mixprec.cross_entropy(x, torch.zeros(2, 3, dtype=torch.long, device=device), reduction="avg")
    with pytest.raises(ValueError, match="mixprec.cross_entropy: target has shape"):
        mixprec.cross_entropy(x, torch.zeros(6, dtype=torch.long, device=device))


# ---- dispatcher and torch.compile ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_opcheck(device, dtype, gen):
    logits, target = make_inputs(13, 1025, dtype, device, gen, ignore_frac=0.3)
    torch.library.opcheck(torch.ops.mixprec.cross_entropy_forward.default, (logits, target, -100))
    torch.library.opcheck(torch.ops.mixprec.cross_entropy_forward.default,
                          (logits.clone().requires_grad_(True), target, -100))
    _, lse = torch.ops.mixprec.cross_entropy_forward(logits, target)
    g = random_tensor(13, torch.float32, device, gen)
    torch.library.opcheck(torch.ops.mixprec.cross_entropy_backward.default, (g, logits, target, lse, -100))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_sees_the_ops(device, dynamic, gen):
    torch._dynamo.reset()

    def step(x, t):
        return mixprec.cross_entropy(x * 2.0, t) + 1.0

    # fullgraph: a graph break (an op dynamo cannot trace) fails; dynamic: the Meta kernels get
    # symbolic N and V.
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for b, t_len, v in ((2, 9, 300), (3, 5, 301)):
        logits, target = make_inputs(b * t_len, v, torch.bfloat16, device, gen, ignore_frac=0.2)
        logits, target = logits.view(b, t_len, v), target.view(b, t_len)
        x1 = logits.clone().requires_grad_(True)
        x2 = logits.clone().requires_grad_(True)
        got, want = compiled(x1, target), step(x2, target)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.backward()
        want.backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_never_syncs_and_captures_in_a_cuda_graph(gen):
    logits, target = make_inputs(64, 50304, torch.bfloat16, "cuda", gen, ignore_frac=0.1)
    g = torch.ones(64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization inside the ops raises
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
            losses, lse = torch.ops.mixprec.cross_entropy_forward(logits, target)
            torch.ops.mixprec.cross_entropy_backward(g, logits, target, lse)
        torch.cuda.current_stream().wait_stream(side)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        losses, lse = torch.ops.mixprec.cross_entropy_forward(logits, target)
        grad = torch.ops.mixprec.cross_entropy_backward(g, logits, target, lse)
    logits.copy_(make_inputs(64, 50304, torch.bfloat16, "cuda", gen)[0])  # new values in the captured buffer
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_err(losses, reference(logits, target)[0], TOL, "replayed losses")
    ref = reference_grad(logits, target, g)
    assert_rel_err(grad, ref, peer_bound(torch.bfloat16, peer_grad(logits, target, g), ref), "replayed grad")


def test_zero_classes_are_refused_by_name():
    with pytest.raises(ValueError, match="mixprec.cross_entropy: logits have 0 classes"):
        mixprec.cross_entropy(torch.empty(4, 0), torch.zeros(4, dtype=torch.long))
