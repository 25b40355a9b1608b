# Held FusedLAMB steps (issue 22): a held step's global gradient norm comes from C++ (HeldNorm, over
# the held params' current grads), and must be the fully checked path's bit for bit through every change.
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import assert_bitwise_equal, random_tensor
from test_held_step import held_of, new_scaler, without_held
from test_optimizer_step_cache import SHAPES, _assert_nothing_changed, _everything, params_of, tensors_of

from mixprec.optimizers import FusedLAMB

PRECISIONS = [torch.float32, torch.float16, torch.bfloat16]
# max_grad_norm of the two groups; 0 and inf turn a group's clipping off. The grads' unscaled norm
# is ~0.2 here (random_tensor at 1e-2 over SHAPES, a scale of 16): 0.05 clips.
CLIPS = {"both": (0.05, 0.05), "first": (0.05, 0.0), "second": (math.inf, 0.05), "none": (0.0, math.inf)}
STEPS = 12
IN_PLACE, NONE_GRAD, NEW_GROUP, CLIP_CHANGED = 2, 4, 7, 9  # the steps with a change (see run)
# The held twin's fully checked steps: the first, the one with a None grad (whose group cannot be
# held) and the one after it, and each step with a change; every held step made is used.
CHECKED = (0, NONE_GRAD, NONE_GRAD + 1, NEW_GROUP, CLIP_CHANGED)
BAD_STEPS = {1: 1, 5: 5, 10: 3}  # step: param given inf/NaN (with a scaler: skipped steps)


def two_groups(dtype, device, gen, clips, extra_device=None):
    params = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in SHAPES]
    opt = FusedLAMB(params[:3], lr=1e-2, max_grad_norm=clips[0], master_weights=dtype != torch.float32)
    second = params[3:]
    if extra_device is not None:  # the second group on another device
        second = [torch.nn.Parameter(p.detach().to(extra_device)) for p in second]
    opt.add_param_group({"params": second, "lr": 3e-3, "max_grad_norm": clips[1], "weight_decay": 0.0,
                         "use_nvlamb": True})
    return opt


def fill_grads(opt, seed: int, in_place: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params_of(opt):
        g = random_tensor(p.shape, p.dtype, "cpu", gen, 1e-2).to(p.device)
        if in_place and p.grad is not None:
            p.grad.copy_(g)  # the same grad tensors, new values (zero_grad(set_to_none=False) and backward)
        else:
            p.grad = g


def run(dtype, device, clips, seed, held, scaler_on, counts, extra_device=None):
    """STEPS steps with every change below; `held` False: every step fully checked and the scaler's
    own check. Returns every tensor after each step; `counts` gets whether each step called the
    Python norm (FusedLAMB._global_grad_norms)."""
    opt = two_groups(dtype, device, torch.Generator().manual_seed(seed), clips, extra_device)
    scaler = new_scaler(device, 2.0**4, held) if scaler_on else None
    real = opt._global_grad_norms

    def counting(*args):
        counts[-1] += 1
        return real(*args)
    opt._global_grad_norms = counting
    log = []
    for i in range(STEPS):
        counts.append(0)
        if not held:
            without_held(opt)
        fill_grads(opt, seed + i, in_place=i == IN_PLACE)
        if scaler is not None and i in BAD_STEPS:  # without a scaler inf would poison every later step
            params_of(opt)[BAD_STEPS[i]].grad.view(-1)[-1] = (math.inf, math.nan)[i % 2]
        if i == NONE_GRAD:
            params_of(opt)[1].grad = None  # left out of the norm and of the step
        if i == NEW_GROUP:
            gen = torch.Generator().manual_seed(seed + 1000)
            new = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in [(5,), (2, 3)]]
            for p in new:
                p.grad = random_tensor(p.shape, dtype, device, gen, 1e-2)
            opt.add_param_group({"params": new, "max_grad_norm": 0.05})
        if i == CLIP_CHANGED:  # clipping turned on or off in the first group
            group = opt.param_groups[0]
            group["max_grad_norm"] = 0.05 if group["max_grad_norm"] in (0.0, math.inf) else 0.0
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        log.append(list(tensors_of(opt)) + ([("scale", scaler._scale)] if scaler is not None else []))
        log[-1] = [(n, t.detach().clone()) for n, t in log[-1]]
    if held:
        assert held_of(opt) is not None
    return log


def assert_same_logs(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert [n for n, _ in x] == [n for n, _ in y], f"step {i}"
        for (name, s), (_, t) in zip(x, y):
            assert_bitwise_equal(s, t, f"step {i}: {name}", nan_equal=True)


def held_and_checked(dtype, device, clips, seed, scaler_on, extra_device=None):
    counts = {True: [], False: []}
    logs = [run(dtype, device, clips, seed, held, scaler_on, counts[held], extra_device) for held in (True, False)]
    assert_same_logs(*logs)
    # The Python norm runs on fully checked steps where some group clips (the group added at
    # NEW_GROUP does), never on a held one: HeldNorm made those norms.
    clipping = [i >= NEW_GROUP or any(0 < c < math.inf for c in clips) for i in range(STEPS)]
    assert counts[False] == [int(c) for c in clipping]
    assert counts[True] == [int(c and i in CHECKED) for i, c in enumerate(clipping)]


@pytest.mark.parametrize("scaler_on", [False, True], ids=["plain", "scaler"])
@pytest.mark.parametrize("clips", CLIPS.values(), ids=CLIPS.keys())
@pytest.mark.parametrize("dtype", PRECISIONS, ids=str)
def test_held_lamb_equals_checked_lamb(dtype, clips, scaler_on, device, seed):
    """Held steps (the norm from HeldNorm, with the scaler its check in the same call) against every
    step fully checked: skipped steps, grad_scale, clipping on or off per group, grads written in
    place, a grad set to None, a group added, max_grad_norm changed."""
    held_and_checked(dtype, device, clips, seed, scaler_on)


@pytest.mark.cuda
def test_held_lamb_across_devices(seed):
    """The first group on the GPU, the second on the CPU: the norms of both combined on the first
    device and copied to the other (HeldNorm's several-devices branch; the copy into the CPU
    blocks, as its kernels read the norm at once). Without a scaler: its held check wants one
    device (HeldSteps.run), and its scale reaches a CPU group by a non-blocking copy."""
    held_and_checked(torch.float16, "cuda", CLIPS["both"], seed, False, extra_device="cpu")


def test_held_lamb_scaler_step_is_one_call(seed):
    """FusedLAMB's step no longer wraps FusedOptimizer.step, so mixprec.GradScaler leaves its inf
    check to the held call (its own check ran before every step while the norm was Python's)."""
    opt = two_groups(torch.float16, "cpu", torch.Generator().manual_seed(seed), CLIPS["both"])
    scaler = new_scaler("cpu", 2.0**4, held=True)
    own = [0]
    real = scaler._unscale_grads_

    def counting(*args):
        own[0] += 1
        return real(*args)
    scaler._unscale_grads_ = counting
    for i in range(4):
        fill_grads(opt, seed + i)
        scaler.step(opt)
        scaler.update()
    assert own[0] <= 1 and held_of(opt) is not None


def _held_opt(dtype, device, seed):
    opt = two_groups(dtype, device, torch.Generator().manual_seed(seed), CLIPS["both"])
    for i in range(3):
        fill_grads(opt, seed + i)
        opt.step()
    assert held_of(opt) is not None and held_of(opt).norm is not None
    return opt


def _sparse(opt):
    p = params_of(opt)[0]
    p.grad = p.grad.to_sparse()


def _float64(opt):
    g = params_of(opt)[4].grad
    g.data = g.data.double()


def _reshaped(opt):  # the norm takes it; the op refuses it after the norm was made
    g = params_of(opt)[1].grad
    g.data = g.data[:-1].clone()


@pytest.mark.parametrize("change", [_sparse, _float64, _reshaped], ids=lambda f: f.__name__.strip("_"))
def test_refused_held_lamb_step_changes_nothing(change, device, seed):
    """A grad the held norm cannot take sends the step down the checked path, which refuses it as
    a fresh optimizer's first step does; nothing changes."""
    opt = _held_opt(torch.float16, device, seed)
    fresh = copy.deepcopy(opt)
    errors = []
    for o in (opt, fresh):
        fill_grads(o, seed + 50)
        change(o)
        before = _everything(o)
        with pytest.raises(Exception) as got:
            o.step()
        _assert_nothing_changed(before, _everything(o))
        errors.append((type(got.value), str(got.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("dtype", PRECISIONS, ids=str)
def test_held_norm_against_float64(dtype, device, gen):
    """HeldNorm's norm of the current grads: float64 reference, divided by the scale; a param
    without a grad gives no norm (the checked path's case)."""
    params = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in SHAPES]
    plan = torch.classes.mixprec.HeldNorm(params, [len(params)])
    for scale in (None, torch.tensor(8.0, device=device), torch.full((1,), 0.25, device=device)):
        for p in params:
            p.grad = random_tensor(p.shape, dtype, device, gen, 1e-2)
        (norm,) = plan.norms(scale)
        want = torch.sqrt(sum(p.grad.double().square().sum() for p in params))
        if scale is not None:
            want = want / scale.double()
        assert norm.dtype == torch.float32 and norm.shape == (1,) and norm.device.type == torch.device(device).type
        rel = abs(norm.double().cpu().item() - want.cpu().item()) / want.cpu().item()
        assert rel < 1e-5, rel
    params[2].grad = None
    assert plan.norms(None) == []


def test_held_norm_refuses_bad_lengths():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    for lengths, what in (([2], "lengths sum to 2 but 3 params"), ([2, 2], "lengths 2 at params\\[2\\] of 3"),
                          ([0, 3], "lengths 0 at params\\[0\\]"), ([], "lengths sum to 0")):
        with pytest.raises(ValueError, match=r"mixprec\.HeldNorm: " + what):
            torch.classes.mixprec.HeldNorm(params, lengths)
    meta = torch.nn.Parameter(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match=r"mix devices cpu and meta; expected one device per length"):
        torch.classes.mixprec.HeldNorm(params + [meta], [4])


def test_step_group_outside_step_still_needs_step(seed):
    """The norm lives for one step only (FusedLAMB._end_step), held or not."""
    opt = _held_opt(torch.float32, "cpu", seed)
    group = opt.param_groups[0]
    with pytest.raises(RuntimeError, match="global gradient norm is computed in step"):
        opt._step_group(group, group["params"], step_tensor=group["step"], lr=1e-2, lr_tensor=None, grad_scale=None,
                        found_inf=None)

