# mixprec.GradScaler under code written for torch.amp.GradScaler's internals: its private names
# with torch's meaning, subclasses overriding torch's hooks (_maybe_opt_step, _unscale_grads_, ...),
# and custom optimizers with _step_supports_amp_scaling that handle the scale they are given.
from __future__ import annotations

import inspect
import math

import pytest
import torch

from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)
from conftest import assert_bitwise_equal, random_tensor
from mixprec.grad_scaler import GradScaler

SCALERS = (torch.amp.GradScaler, GradScaler)


def torch_private_names() -> set[str]:
    """The private attributes and methods of an enabled torch scaler (dunders excluded)."""
    instance = torch.amp.GradScaler("cpu")
    names = {n for n in vars(instance) if n.startswith("_")}
    names |= {n for n, _ in inspect.getmembers(torch.amp.GradScaler, callable)
              if n.startswith("_") and not n.startswith("__")}
    return names


def test_every_private_name_of_torch_exists():
    ours = GradScaler("cpu")
    missing = sorted(n for n in torch_private_names() if not hasattr(ours, n))
    assert not missing, f"torch.amp.GradScaler's names missing from mixprec.GradScaler: {missing}"


class Loop:
    """A tiny model trained with optional inf/NaN injected into a gradient after backward."""

    def __init__(self, seed: int, make_opt):
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(random_tensor((5,), torch.float32, "cpu", gen)) for _ in range(3)]
        self.opt = make_opt(self.params)
        self.x = [random_tensor((5,), torch.float32, "cpu", gen) for _ in range(8)]

    def run(self, scaler, bad: dict[int, float]) -> list:
        log = []
        for i, x in enumerate(self.x):
            self.opt.zero_grad(set_to_none=True)
            loss = sum(((p * x) ** 2).sum() for p in self.params)
            scaler.scale(loss).backward()
            if i in bad:
                self.params[i % 3].grad[i % 5] = bad[i]
            log.append(scaler.step(self.opt))
            scaler.update()
            log.append((scaler.get_scale(), scaler._get_growth_tracker(), [p.detach().clone() for p in self.params]))
        return log


def assert_same_logs(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, tuple):
            assert x[:2] == y[:2], f"entry {i}: scale/tracker {x[:2]} != {y[:2]}"
            for p, q in zip(x[2], y[2]):
                assert_bitwise_equal(q, p, f"entry {i}: param")
        else:
            assert x == y, f"entry {i}: step returned {y!r}, torch's scaler {x!r}"


def subclass_of(base):
    """A subclass overriding torch's hooks the way user code does; records what it saw."""

    class Sub(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen = []

        def _lazy_init_scale_growth_tracker(self, dev):
            self._init_scale = 32.0  # a subclass picking its own start
            super()._lazy_init_scale_growth_tracker(dev)

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            self.seen.append(("unscale", allow_fp16))
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            found = sum(float(v) for v in optimizer_state["found_inf_per_device"].values())
            self.seen.append(("maybe_step", found))
            if len(self.seen) % 4 == 0:  # every second step: the subclass vetoes it
                return "vetoed"
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

        def _get_scale_async(self):
            self.seen.append(("get_scale_async",))
            return super()._get_scale_async()

    return Sub


@pytest.mark.parametrize("fused", [False, True])
def test_subclass_overrides_of_torchs_hooks_take_effect(fused, seed):
    make = (lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True)) if fused else (lambda ps: torch.optim.SGD(ps, lr=0.1))
    logs, seen = [], []
    for base in SCALERS:
        scaler = subclass_of(base)("cpu", growth_interval=2)
        logs.append(Loop(seed, make).run(scaler, {2: math.inf, 5: math.nan}))
        seen.append(scaler.seen)
    assert_same_logs(*logs)
    assert seen[1] == seen[0]
    assert logs[1][1][0] == 32.0  # the overridden initial scale was used (growth_interval 2: not grown yet)
    if not fused:
        assert "vetoed" in logs[1]


def test_a_subclass_that_sets_scale_and_tracker_itself_still_updates():
    # torch-style code creating _scale/_growth_tracker directly (no super()): mixprec's own trackers
    # (hysteresis, skipped steps) are created beside them.
    class Direct(GradScaler):
        def _lazy_init_scale_growth_tracker(self, dev):
            self._scale = torch.full((), 16.0, device=dev)
            self._growth_tracker = torch.zeros((), dtype=torch.int32, device=dev)

    for kwargs in ({}, {"hysteresis": 2}):
        log = Loop(0, lambda ps: torch.optim.SGD(ps, lr=0.1)).run(Direct("cpu", growth_interval=3, **kwargs), {1: math.inf})
        first = 8.0 if not kwargs else 16.0
        assert [e[0] for e in log[1::2]][:3] == [16.0, first, first]


def test_private_values_mean_what_torchs_mean():
    theirs, ours = (cls("cpu", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
                    for cls in SCALERS)
    for s in (theirs, ours):
        assert s._scale is None and s._growth_tracker is None and s._init_scale == 8.0
    for s in (theirs, ours):
        Loop(1, lambda ps: torch.optim.SGD(ps, lr=0.1)).run(s, {3: math.inf})
    for name in ("_init_scale", "_init_growth_tracker", "_growth_factor", "_backoff_factor", "_growth_interval",
                 "_enabled", "_device", "_per_optimizer_states"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("_scale", "_growth_tracker"):
        assert_bitwise_equal(getattr(ours, name), getattr(theirs, name), name)
    assert ours._get_scale_async() is ours._scale
    assert ours._check_scale_growth_tracker("x") == (ours._scale, ours._growth_tracker)
    ours._init_scale = 2.0  # like torch: the start of a scale not yet created
    fresh = GradScaler("cpu")
    fresh._init_scale = 2.0
    assert fresh.get_scale() == 2.0


class CarelessScaledSGD(torch.optim.Optimizer):
    """A custom optimizer that unscales itself and then scribbles on the grad_scale and found_inf it
    was given."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        scale, found = self.grad_scale, self.found_inf
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = group["lr"] * p.grad / scale
                    p.sub_(torch.where(found != 0, torch.zeros_like(update), update))
        scale.mul_(0.0)  # must not reach the scaler's own scale (torch hands a product: a copy)
        found.zero_()  # nor hide the overflow from update() (torch hands a sum: a copy)


def test_a_custom_amp_optimizer_gets_copies_of_scale_and_found_inf(seed):
    logs = [Loop(seed, lambda ps: CarelessScaledSGD(ps, lr=0.1)).run(cls("cpu", init_scale=2.0**8, growth_interval=2),
                                                                    {3: math.inf}) for cls in SCALERS]
    assert_same_logs(*logs)
    assert logs[1][-1][0] > 0
