# Conformance of mixprec.GradScaler with torch.amp.GradScaler on the CPU: each scenario runs twice on
# identical models, data and optimizers, once per scaler, and the two logs (scale, growth tracker,
# params, .grad after step, optimizer state, state_dict, errors raised) must agree bit for bit.
# Where mixprec deliberately differs, DIFFERENCES below says so and tests both sides.
from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)
from conftest import assert_bitwise_equal, random_tensor
from mixprec._step_guard import StepGuard
from mixprec.grad_scaler import GradScaler
from mixprec.optimizers import FusedAdam, FusedSGD

OTHER = {torch.amp.GradScaler: GradScaler, GradScaler: torch.amp.GradScaler}

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True, amsgrad=True),
    # torch's fused CPU kernels and mixprec's: both unscale and skip inside their step.
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "mixprec_adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "mixprec_sgd": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
}
FUSED = ("adam_fused", "sgd_fused", "mixprec_adam", "mixprec_sgd")


class Side:
    """One side of a scenario: a model, its optimizers and a scaler of class ``cls``, and a log of
    everything observable, compared against the other side's."""

    def __init__(self, cls, opt_name: str, seed: int, *, n_opts: int = 1, frozen: bool = False,
                 dtype=torch.float32, device="cpu", sync_skip=None):
        gen = torch.Generator().manual_seed(seed)
        self.cls, self.log, self.s = cls, [], None
        # mixprec's own option; torch's scaler always reads found_inf on the host.
        self.extra = {} if cls is torch.amp.GradScaler or sync_skip is None else {"sync_skip": sync_skip}
        self.device, self.kind = device, torch.device(device).type
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, scale=0.5))
        self.model.to(device, dtype)
        if frozen:  # a frozen param inside the optimizer: never a grad
            self.model[0].bias.requires_grad_(False)
        self.idle = torch.nn.Parameter(random_tensor((4,), dtype, device, gen))  # never in the loss
        make = OPTIMIZERS[opt_name]
        ps = list(self.model.parameters())
        self.opts = [make(ps)] if n_opts == 1 else [make(ps[:2]), make(ps[2:])]
        self.idle_opt = make([self.idle])
        if self.kind != "cpu" and not sync_skip:
            # mixprec's device-side skip switches GPU groups to capturable=True (a different
            # rounding of the bias corrections); give torch's side the same arithmetic, so what
            # is compared is the scaler's semantics.
            for opt in [*self.opts, self.idle_opt]:
                StepGuard.make_capturable(opt)
        self.data = [(random_tensor((5, 6), dtype, device, gen), random_tensor((5, 3), dtype, device, gen))
                     for _ in range(10)]

    def scaler(self, **kwargs):
        self.s = self.cls(self.kind, **kwargs, **self.extra)
        return self.s

    def backward(self, i: int, poison: float | None = None) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        x, y = self.data[i]
        loss = torch.nn.functional.mse_loss(self.model(x).float(), y.float())
        self.s.scale(loss).backward()
        if poison is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            g = grads[i % len(grads)]
            g.view(-1)[(7 * i + 3) % g.numel()] = poison

    def call(self, what: str, fn) -> None:
        try:
            self.log.append((what, "ok", fn()))
        except Exception as e:  # compared with the other side's
            self.log.append((what, "raised", e))

    def step_all(self, opts=None) -> None:
        for k, opt in enumerate(self.opts if opts is None else opts):
            self.call(f"step {k}", lambda: self.s.step(opt))

    def snap(self, tag) -> None:
        s = self.s
        state = [{k: v.clone() if isinstance(v, torch.Tensor) else v for st in opt.state_dict()["state"].values()
                  for k, v in st.items()} for opt in self.opts]
        sd = s.state_dict()
        self.log.append((tag, "state", {
            "scale": s.get_scale(), "tracker": s._get_growth_tracker(),
            "params": [p.detach().clone() for p in self.model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in self.model.parameters()],
            "opt_state": state,
            "state_dict": {k: sd[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                                              "_growth_tracker") if k in sd},
        }))

    def iterate(self, i: int, poison: float | None = None, new_scale=None, clip: bool = False) -> None:
        self.backward(i, poison)
        if clip:
            for opt in self.opts:
                self.call("unscale_", lambda: self.s.unscale_(opt))
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.1)
        self.step_all()
        self.call("update", lambda: self.s.update(new_scale))
        self.snap(i)


def assert_same_value(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
        assert_bitwise_equal(a, b, what, nan_equal=True)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_value(x, y, f"{what}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same_value(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), what
    else:  # numbers by value (torch keeps a loaded numpy int as it came), floats by sign too
        assert a == b, f"{what}: {a!r} != {b!r}"
        if isinstance(a, float):
            assert math.copysign(1.0, a) == math.copysign(1.0, b), f"{what}: {a!r} != {b!r}"


def assert_same_log(theirs: Side, ours: Side) -> None:
    assert [e[:2] for e in ours.log] == [e[:2] for e in theirs.log], "the scenarios diverged"
    for (what, kind, t), (_, _, o) in zip(theirs.log, ours.log):
        if kind == "raised":  # ours may be a subclass (ValueError + AssertionError) naming more
            assert isinstance(o, type(t)), f"{what}: raised {type(o).__name__}, torch {type(t).__name__}"
            assert str(t) in str(o), f"{what}: {o} does not say torch's {t}"
        else:
            assert_same_value(o, t, f"{what}")


# ---- the scenarios: each drives one Side; the same code runs for both scalers -------------------

def clean(t):
    t.scaler(init_scale=2.0**10, growth_interval=2)
    for i in range(5):
        t.iterate(i)


def overflow_at_k(t):
    t.scaler(init_scale=2.0**10, growth_interval=2)
    for i in range(6):
        t.iterate(i, poison={1: math.inf, 2: math.nan, 4: -math.inf}.get(i))


def unscale_clip_step(t):
    t.scaler(init_scale=2.0**8, growth_interval=2)
    for i in range(5):
        t.iterate(i, poison=math.inf if i == 2 else None, clip=True)


def growth_interval_1(t):
    t.scaler(init_scale=2.0**4, growth_interval=1)
    for i in range(5):
        t.iterate(i, poison=math.nan if i == 3 else None)


def growth_interval_numpy(t):  # issue 19.8b: numpy ints as torch takes them
    t.scaler(init_scale=2.0**4, growth_interval=np.int64(2))
    for i in range(5):
        t.iterate(i)


def growth_interval_0(t):  # torch: the tracker counts on and the scale never grows
    t.scaler(init_scale=2.0**4, growth_interval=0)
    for i in range(5):
        t.iterate(i, poison=math.inf if i == 2 else None)


# No overflow on a first step: torch's SGD(fused=True) then keeps a momentum buffer of uninitialized
# memory (the skipped step creates it), which differs from run to run whatever the scaler.
def default_hysteresis(t):  # defaults, incl. hysteresis 1: back off on every overflow, as torch
    t.scaler()
    for i in range(5):
        t.iterate(i, poison=math.inf if i in (1, 2, 4) else None)


def two_optimizers(t):
    t.scaler(init_scale=2.0**6, growth_interval=2)
    for i in range(5):
        t.iterate(i, poison=math.inf if i == 2 else None)  # index 2 % 4 grads: the second optimizer's


def frozen_params(t):
    t.scaler(init_scale=2.0**6, growth_interval=2)
    for i in range(4):
        t.iterate(i, poison=math.nan if i == 1 else None)


def idle_optimizer_beside_a_busy_one(t):  # issue 19.8a: an idle fused optimizer is a no-op
    t.scaler(init_scale=2.0**6, growth_interval=2)
    for i in range(3):
        t.backward(i)
        t.step_all([t.opts[0], t.idle_opt])
        t.call("update", t.s.update)
        t.snap(i)
        t.log.append(("idle grad", "ok", t.idle.grad))


def only_an_idle_optimizer(t):  # the idle step as torch; then update has no inf check to use
    t.scaler(init_scale=2.0**6)
    t.backward(0)
    t.step_all([t.idle_opt])
    t.call("update", t.s.update)
    t.call("update(new_scale)", lambda: t.s.update(32.0))
    t.snap(0)


def update_new_scale_forms(t):  # issue 19.8e: what torch's update(new_scale) takes
    t.scaler(init_scale=2.0**6)
    on = {"device": t.device}
    forms = [512.0, torch.tensor(64.0, **on), torch.tensor(32.0, dtype=torch.float64, **on), torch.tensor(16, **on),
             np.float64(8.0), None]
    for i, new_scale in enumerate(forms):
        t.iterate(i, poison=math.inf if i == 3 else None, new_scale=new_scale)


def state_dict_to_the_other_scaler(t):  # torch's checkpoint into ours and ours into torch's
    t.scaler(init_scale=2.0**9, growth_interval=3)
    for i in range(3):
        t.iterate(i, poison=math.inf if i == 1 else None)
    other = OTHER[t.cls](t.kind)
    other.load_state_dict(t.s.state_dict())
    t.s = other
    for i in range(3, 8):
        t.iterate(i, poison=math.nan if i == 6 else None)


def state_dict_round_trip_and_pickle(t):
    t.scaler(init_scale=2.0**9, growth_interval=2)
    for i in range(3):
        t.iterate(i, poison=math.inf if i == 1 else None)
    again = t.cls(t.kind, init_scale=3.0)
    again.load_state_dict(t.s.state_dict())
    t.s = pickle.loads(pickle.dumps(again))
    for i in range(3, 6):
        t.iterate(i)


def state_dict_of_tensors_and_numpy(t):  # issue 19.8f: 0-dim tensors and numpy scalars load
    for value in (torch.tensor(8.0), np.float32(16.0)):
        t.scaler()
        sd = t.s.state_dict()
        sd.update(scale=value, _growth_tracker=np.int64(1), growth_interval=np.int32(2))
        t.s.load_state_dict(sd)
        for i in range(3):
            t.iterate(i)


def disabled(t):
    t.scaler(enabled=False)
    for i in range(3):
        t.iterate(i, poison=math.inf if i == 1 else None, clip=True)


def nested_outputs(t):
    t.scaler(init_scale=2.0**5)
    for i in range(3):
        for opt in t.opts:
            opt.zero_grad(set_to_none=True)
        out = t.model(t.data[i][0])
        scaled = t.s.scale([out.sum(), (out.square().mean(), out[0, 0])])
        (scaled[0] + scaled[1][0] + scaled[1][1]).backward()
        t.step_all()
        t.call("update", t.s.update)
        t.snap(i)


def fp16_grads(t):  # issue 20.9: torch refuses to unscale fp16 grads (a fused step needs no unscale)
    t.scaler(init_scale=2.0**6)
    for i in range(2):
        t.backward(i)
        for opt in t.opts:
            t.call("unscale_", lambda: t.s.unscale_(opt))
        t.snap(f"after unscale_ {i}")
        t.step_all()
        t.call("update", t.s.update)
        t.snap(i)


SCENARIOS = {f.__name__: (f, kw) for f, kw in [
    (clean, {}), (overflow_at_k, {}), (unscale_clip_step, {}), (growth_interval_1, {}),
    (growth_interval_numpy, {}), (growth_interval_0, {}), (default_hysteresis, {}),
    (two_optimizers, {"n_opts": 2}), (frozen_params, {"frozen": True}), (idle_optimizer_beside_a_busy_one, {}),
    (only_an_idle_optimizer, {}), (update_new_scale_forms, {}), (state_dict_to_the_other_scaler, {}),
    (state_dict_round_trip_and_pickle, {}), (state_dict_of_tensors_and_numpy, {}), (disabled, {}),
    (nested_outputs, {}), (fp16_grads, {"dtype": torch.float16}),
]}


# A non-fused optimizer's overflowing step is skipped one of two ways: on the host (torch's way:
# read found_inf, do not call step; mixprec's default on the CPU) or on the device (call step and
# select the snapshot back; mixprec's default on a GPU). "other" forces the path the device does
# not take by default (sync_skip=False on the CPU, True on a GPU), so both run on both devices.
OPT_PATHS = [(name, "default") for name in OPTIMIZERS] + [(name, "other") for name in OPTIMIZERS
                                                         if name not in FUSED]


@pytest.mark.parametrize(("opt_name", "skip_path"), OPT_PATHS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_same_as_torch(scenario, opt_name, skip_path, device, seed):
    fn, kwargs = SCENARIOS[scenario]
    sync_skip = None if skip_path == "default" else torch.device(device).type != "cpu"
    sides = [Side(cls, opt_name, seed, device=device, sync_skip=sync_skip, **kwargs)
             for cls in (torch.amp.GradScaler, GradScaler)]
    for side in sides:
        fn(side)
    assert_same_log(*sides)


# After a fused step torch's fused optimizers leave .grad unscaled (their kernel writes it back);
# after an overflow they leave it as it was. mixprec's must do the same under either scaler.
@pytest.mark.parametrize(("theirs", "ours"), [("adam_fused", "mixprec_adam"), ("sgd_fused", "mixprec_sgd")])
@pytest.mark.parametrize("overflow", [False, True])
def test_grad_after_a_mixprec_fused_step_is_what_torch_fused_leaves(theirs, ours, overflow, seed):
    sides = [Side(torch.amp.GradScaler, theirs, seed), Side(GradScaler, ours, seed)]
    for side in sides:
        side.scaler(init_scale=2.0**10)
        side.backward(1, poison=math.inf if overflow else None)
        side.step_all()
    for i, (a, b) in enumerate(zip(*[list(s.model.parameters()) for s in sides])):
        assert_bitwise_equal(b.grad, a.grad, f".grad {i} after the step", nan_equal=True)


# ---- deliberate differences ---------------------------------------------------------------------
# (what, torch.amp.GradScaler, mixprec.GradScaler); the ones about values are tested below, the
# refusals in test_misuse_grad_scaler.py.
DIFFERENCES = [
    ("growth_interval lowered below the growth tracker", "never grows again (tracker must equal it)",
     "grows on the next clean step"),
    ("update(new_scale=1024) / numpy float32", "AttributeError", "accepted as the float"),
    ("a scale of 0, inf, NaN or < 0 (init_scale, new_scale, checkpoint)", "taken: training is corrupted",
     "refused, naming the argument; nothing changes"),
    ("backoff_factor <= 0, growth_factor inf, min/max_scale relations, setters", "taken", "refused"),
    ("load_state_dict with bad or missing values", "writes fields until it fails", "validates all first"),
    ("fused step with no gradient at all", "found_inf = the int 0", "found_inf = a zero tensor"),
    ("fused optimizer.step raises", "grad_scale/found_inf stay on it", "removed"),
    ("non-fused skip on the GPU", "reads found_inf on the host", "undone on the device (sync_skip)"),
    ("additions", "-", "hysteresis, min/max_scale, skipped_steps, scale_history, process_group"),
]


def run_clean_steps(scaler, steps: int) -> list[float]:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for _ in range(steps):
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_lowered_growth_interval_grows_on_the_next_clean_step_where_torch_never_grows():
    scales = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        s = cls("cpu", init_scale=4.0, growth_interval=10)
        run_clean_steps(s, 5)
        s.set_growth_interval(2)  # tracker 5 > 2
        scales[cls] = run_clean_steps(s, 3)
    assert scales[torch.amp.GradScaler] == [4.0, 4.0, 4.0]
    assert scales[GradScaler] == [8.0, 8.0, 16.0]


def test_update_takes_an_int_and_a_numpy_float32_where_torch_raises():
    for new_scale in (1024, np.float32(1024.0)):
        theirs, ours = torch.amp.GradScaler("cpu"), GradScaler("cpu")
        for s in (theirs, ours):
            run_clean_steps(s, 1)
        with pytest.raises(AttributeError):
            theirs.update(new_scale)
        ours.update(new_scale)
        assert ours.get_scale() == 1024.0 and ours._get_growth_tracker() == 1
