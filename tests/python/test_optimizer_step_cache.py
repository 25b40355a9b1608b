# What FusedOptimizer.step and GradScaler keep between steps (optimizers/_step_cache.py, issue 22)
# never goes stale: after each kind of change a stepped optimizer acts bit for bit as a fresh copy.
from __future__ import annotations

import copy
import random
import re

import pytest
import torch
from conftest import CHUNK, assert_bitwise_equal, inject_non_finite, random_tensor

import mixprec
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

FAMILIES = {
    "adam": lambda ps, **kw: FusedAdam(ps, lr=1e-2, weight_decay=0.01, **kw),
    "sgd": lambda ps, **kw: FusedSGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01, **kw),
    "lamb": lambda ps, **kw: FusedLAMB(ps, lr=1e-2, **kw),
    "adagrad": lambda ps, **kw: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01, **kw),
    "novograd": lambda ps, **kw: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01, **kw),
}
# Sizes straddling a chunk, a zero-size and a one-element tensor, a 2-D one.
SHAPES = [(7,), (CHUNK + 1,), (0,), (1,), (3, 5), (33,)]
STEPS = 3


def make(family: str, dtype: torch.dtype, gen: torch.Generator, device="cpu", **kw):
    params = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in SHAPES]
    kw.setdefault("master_weights", dtype != torch.float32)
    return FAMILIES[family](params, **kw)


def params_of(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def set_grads(opt, gen: torch.Generator, dtypes: dict | None = None) -> None:
    """New grad tensors (as every backward after zero_grad(set_to_none=True)), the same values
    for any optimizer with the same parameter shapes; params without requires_grad get None."""
    for i, p in enumerate(params_of(opt)):
        p.grad = random_tensor(p.shape, p.dtype, p.device, gen, 1e-2) if p.requires_grad else None
        if p.grad is not None and i in (dtypes or {}):
            p.grad.data = p.grad.data.to(dtypes[i])  # torch refuses `p.grad = ` of another dtype


def tensors_of(opt) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a step may read or write, named by position, in a fixed order."""
    out = []
    for gi, g in enumerate(opt.param_groups):
        for k in sorted(k for k, v in g.items() if isinstance(v, torch.Tensor)):
            out.append((f"group{gi}.{k}", g[k]))
        for pi, p in enumerate(g["params"]):
            out.append((f"p{gi}.{pi}", p))
            if p.grad is not None:
                out.append((f"p{gi}.{pi}.grad", p.grad))
            for k in sorted(opt.state.get(p, {})):
                v = opt.state[p][k]
                if isinstance(v, torch.Tensor):
                    out.append((f"p{gi}.{pi}.{k}", v))
    return out


def outcome(opt, seed: int, dtypes: dict | None = None):
    """Steps once with grads from ``seed``: the tensors after it, or the error it raised."""
    set_grads(opt, torch.Generator().manual_seed(seed), dtypes)
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - the error is the outcome compared
        return ("error", type(e), str(e))
    return ("ok", [(n, t.detach().clone()) for n, t in tensors_of(opt)])


def assert_same_outcome(a, b) -> None:
    assert a[0] == b[0], (a if a[0] == "error" else "ok", b if b[0] == "error" else "ok")
    if a[0] == "error":
        assert a[1:] == b[1:]
        return
    assert [n for n, _ in a[1]] == [n for n, _ in b[1]]
    for (name, x), (_, y) in zip(a[1], b[1]):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert_bitwise_equal(x, y, name, nan_equal=True)


def _state_key(opt, p) -> str:
    return next(k for k in opt._state_rules if k in opt.state[p])


# Each change is made after STEPS clean steps, to the optimizer and its parameters.
def replace_data(opt, gen):
    p = params_of(opt)[1]
    p.data = random_tensor(p.shape, p.dtype, p.device, gen)


def grad_dtype(opt, gen):
    opt._next_grad_dtypes = {0: torch.bfloat16 if params_of(opt)[0].dtype != torch.bfloat16 else torch.float16}


def freeze(opt, gen):
    params_of(opt)[4].requires_grad_(False)


def add_group(opt, gen):
    p = params_of(opt)[0]
    opt.add_param_group({"params": [torch.nn.Parameter(random_tensor((9,), p.dtype, p.device, gen))], "lr": 3e-3})


def load_older(opt, gen):
    opt.load_state_dict(opt._saved)


def lr_tensor(opt, gen):
    opt.param_groups[0]["lr"] = torch.tensor(5e-3)


def lr_scheduled(opt, gen):
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5  # a new float, as schedulers set


def lr_tensor_in_place(opt, gen):
    opt.param_groups[0]["lr"] = torch.tensor(5e-3)
    opt.step()
    opt.param_groups[0]["lr"].fill_(2e-3)  # the same tensor object, a new value


def weight_decay(opt, gen):
    opt.param_groups[0]["weight_decay"] = 0.25


def param_dtype(opt, gen):
    p = params_of(opt)[3]
    p.data = p.data.to(torch.float16 if p.dtype == torch.float32 else torch.float32)


def masters_on(opt, gen):
    opt.master_weights = not opt.param_groups[0]["master_weights"]


def state_tensor(opt, gen):
    p = params_of(opt)[5]
    key = _state_key(opt, p)
    opt.state[p][key] = opt.state[p][key] * 0.5


def state_dict_replaced(opt, gen):
    p = params_of(opt)[5]
    opt.state[p] = {k: (v.clone() * 0.5 if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}


def state_cleared(opt, gen):
    opt.state[params_of(opt)[1]].clear()


def reorder(opt, gen):
    ps = opt.param_groups[0]["params"]
    ps[0], ps[5] = ps[5], ps[0]


def drop_param(opt, gen):
    opt.param_groups[0]["params"].pop(0)


CHANGES = [replace_data, grad_dtype, freeze, add_group, load_older, lr_tensor, lr_scheduled, lr_tensor_in_place,
           weight_decay, param_dtype, masters_on, state_tensor, state_dict_replaced, state_cleared, reorder, drop_param]


# Every family in fp32 and O2 fp16 (fp32 masters), two in O2 bf16.
FAMILY_DTYPES = [(f, d) for f in FAMILIES for d in (torch.float32, torch.float16)] + [
    ("adam", torch.bfloat16), ("sgd", torch.bfloat16)]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES, ids=lambda x: x if isinstance(x, str) else str(x)[6:])
def test_change_after_steps_acts_as_a_fresh_copy(family, dtype, change, device, gen, seed):
    opt = make(family, dtype, gen, device)
    for i in range(STEPS):
        outcome(opt, seed + i)
        if i == 0:
            opt._saved = copy.deepcopy(opt.state_dict())
    change(opt, gen)
    dtypes = getattr(opt, "_next_grad_dtypes", None)
    fresh = copy.deepcopy(opt)  # copies drop every cache: this one starts from scratch
    for i in range(2):  # the step right after the change, and one more
        a = outcome(opt, seed + 100 + i, dtypes)
        b = outcome(fresh, seed + 100 + i, dtypes)
        assert_same_outcome(a, b)
        if a[0] == "error":
            break


# -- misuse after clean steps: refused with the first step's words, and nothing changes ---------

def grad_fp64(opt):
    g = params_of(opt)[1].grad
    g.data = g.data.double()


def param_overlapping(opt):
    p = params_of(opt)[5]
    p.data = torch.zeros(1, dtype=p.dtype, device=p.device).expand(p.shape)  # every element one address


def param_non_contiguous(opt):
    p = params_of(opt)[4]
    p.data = torch.zeros(5, 3, dtype=p.dtype, device=p.device).t()  # (3, 5) with transposed strides: not its state's


def grad_sparse(opt):
    p = params_of(opt)[1]
    p.grad = p.grad.to_sparse()


def grad_is_param(opt):
    p = params_of(opt)[0]
    p.grad = p.data


def mixed_devices(opt):
    # A CPU tensor cannot take meta data through .data: swap the param itself (cuda_moved_param
    # below moves one through .data on a GPU machine).
    p = params_of(opt)[3]
    meta = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
    meta.grad = torch.empty_like(meta)
    opt.param_groups[0]["params"][3] = meta


def cuda_moved_param(opt):
    p = params_of(opt)[3]
    p.data = p.data.cpu() if p.is_cuda else p.data.cuda()  # what a partial model.cuda() does
    p.grad = torch.ones_like(p)


def bad_lr(opt):
    opt.param_groups[0]["lr"] = -1.0


def betas_list_mutated(opt):
    group = opt.param_groups[0]
    if "betas" not in group:
        group["weight_decay"] = float("nan")
        return
    group["betas"] = [0.9, 0.99]
    opt.step()
    group["betas"][0] = 2.0  # the same list object, now invalid


def lr_tensor_reshaped(opt):
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    opt.step()
    opt.param_groups[0]["lr"].set_(torch.tensor([1e-3, 2e-3]))  # the same object, two elements


def group_rule_broken(opt):
    group = opt.param_groups[0]
    if "nesterov" not in group:
        group["eps"] = -1e-8
        return
    group.update(nesterov=True, dampening=0.0)  # valid with momentum 0.9
    opt.step()
    group["momentum"] = 0.0  # only this key changes; the rule spans three


def state_fp64(opt):
    p = params_of(opt)[5]
    key = _state_key(opt, p)
    opt.state[p][key] = opt.state[p][key].double()


MISUSES = [grad_fp64, param_overlapping, param_non_contiguous, grad_sparse, grad_is_param, mixed_devices, bad_lr,
           betas_list_mutated, lr_tensor_reshaped, group_rule_broken, state_fp64,
           pytest.param(cuda_moved_param, marks=pytest.mark.cuda)]


def _everything(opt) -> list:
    """Every tensor (values and identity) and every host value of the groups and the state."""
    out = []
    for gi, g in enumerate(opt.param_groups):
        out.append(sorted((k, repr(v)) for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)))
    out.append(len(opt.state))
    for name, t in tensors_of(opt):
        value = t if t.device.type == "meta" else (t.to_dense() if t.is_sparse else t).detach().clone()
        out.append((name, value, id(t)))
    return out


def _assert_nothing_changed(before, after) -> None:
    assert len(before) == len(after)
    for b, a in zip(before, after):
        if isinstance(b, tuple) and len(b) == 3 and isinstance(b[1], torch.Tensor):
            assert b[0] == a[0] and b[2] == a[2], f"{b[0]} was replaced"
            if b[1].device.type != "meta":
                assert_bitwise_equal(a[1], b[1], f"{b[0]} was modified", nan_equal=True)
        else:
            assert a == b


@pytest.mark.parametrize("misuse", MISUSES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_misuse_after_clean_steps_is_refused_as_on_a_first_step(family, dtype, misuse, device, gen, seed):
    opt = make(family, dtype, gen, device)
    for i in range(STEPS):
        outcome(opt, seed + i)
    set_grads(opt, torch.Generator().manual_seed(seed + 50))
    misuse(opt)
    before = _everything(opt)
    with pytest.raises(Exception) as got:
        opt.step()
    _assert_nothing_changed(before, _everything(opt))
    # The same optimizer without what its steps kept: what a first step would say.
    opt.__dict__.pop("_step_cache")
    with pytest.raises(Exception) as want:
        opt.step()
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    _assert_nothing_changed(before, _everything(opt))


@pytest.mark.parametrize("misuse", [grad_sparse, mixed_devices, bad_lr], ids=lambda f: f.__name__)
def test_misuse_words_equal_a_new_optimizers_first_step(misuse, gen):
    """The messages Python itself writes are those of a never-stepped optimizer too."""
    stepped = make("adam", torch.float32, gen)
    for i in range(STEPS):
        outcome(stepped, i)
    new = make("adam", torch.float32, gen)
    for opt in (stepped, new):
        set_grads(opt, torch.Generator().manual_seed(7))
        misuse(opt)
    with pytest.raises(Exception) as a:
        stepped.step()
    with pytest.raises(Exception) as b:
        new.step()
    assert type(a.value) is type(b.value) and str(a.value) == str(b.value)


# -- the scaler's one-call check: same flags and skips as its per-parameter path -----------------

@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_scaler_skips_a_non_finite_step_after_clean_ones(dtype, value, where, device, gen, seed):
    opt = make("adam", dtype, gen, device)
    scaler = mixprec.GradScaler(torch.device(device).type, init_scale=4.0, growth_interval=1000, sync_skip=False)
    scaler.scale(torch.ones((), device=device))  # makes the scale, as scaling a loss does
    for i in range(STEPS):
        set_grads(opt, torch.Generator().manual_seed(seed + i))
        scaler.step(opt)
        scaler.update()
    set_grads(opt, torch.Generator().manual_seed(seed + 9))
    victim = random.Random(seed).choice([p for p in params_of(opt) if p.numel() > 0])
    inject_non_finite(victim.grad, where, value, gen)
    before = [(n, t.clone()) for n, t in tensors_of(opt) if not n.endswith(".grad")]
    scaler.step(opt)
    scaler.update()
    after = [(n, t) for n, t in tensors_of(opt) if not n.endswith(".grad")]
    assert [n for n, _ in before] == [n for n, _ in after]
    for (name, b), (_, a) in zip(before, after):
        assert_bitwise_equal(a, b, f"{name} changed in a skipped step", nan_equal=True)
    assert scaler.get_scale() == 2.0


@pytest.mark.parametrize("kind", ["frozen", "fp64", "fp16_unscale", "sparse"])
def test_scaler_irregular_grads_after_clean_steps(kind, gen, seed):
    """torch.optim.SGD under mixprec.GradScaler: grads the one-call path cannot take (a missing
    one, float64, float16 for unscale_, sparse) after clean steps get the per-parameter path's
    results, or its refusal with nothing changed."""
    dtype = torch.float64 if kind == "fp64" else torch.float32
    params = [torch.nn.Parameter(random_tensor(s, dtype, "cpu", gen)) for s in SHAPES]
    opt = torch.optim.SGD(params, lr=0.5)
    scaler = mixprec.GradScaler("cpu", init_scale=8.0, sync_skip=True)
    scaler.scale(torch.ones(()))
    for i in range(STEPS):
        set_grads(opt, torch.Generator().manual_seed(seed + i))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    set_grads(opt, torch.Generator().manual_seed(seed + 9))
    if kind == "frozen":
        params[2].grad = params[4].grad = None
    elif kind == "fp16_unscale":
        params[5].data = params[5].data.half()
        params[5].grad = params[5].grad.half()
    elif kind == "sparse":
        params[1].grad = params[1].grad.to_sparse()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    if kind == "fp16_unscale":
        before = [p.detach().clone() for p in params]
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients.*param group 0 param 5"):
            scaler.unscale_(opt)
        for p, b, g in zip(params, before, grads):
            assert_bitwise_equal(p, b, "param")
            assert_bitwise_equal(p.grad, g, "grad")
        assert scaler.get_scale() == 8.0
        return
    scaler.unscale_(opt)
    for p, g in zip(params, grads):
        if g is None:
            assert p.grad is None
            continue
        got = p.grad.to_dense() if p.grad.is_sparse else p.grad
        want = (g.to_dense() if g.is_sparse else g).double() * (1.0 / 8.0)
        assert_bitwise_equal(got, want.to(got.dtype), "unscaled grad")
    found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
    assert found == 0.0
