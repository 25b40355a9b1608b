# Tests of mixprec.update_scale_ on CPU and CUDA: the dynamic loss-scale rule (growth, backoff,
# hysteresis, bounds, never inf) step by step against a Python model and torch's op; bad arguments.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import assert_bitwise_equal, check_rejected, scalar
from test_loss_scale import f32  # shared helpers

FLOOR = 2.0**-126  # kernels::kScaleFloor: no backoff goes below the smallest normal float32


# ---- update_scale_ -----------------------------------------------------------------------------------


class RefScaler:
    """The scale-update rule of csrc/kernels/loss_scale.h in float64 Python, stored as the op
    stores it (float32 scale, int32 trackers), counting which branch of the rule fired. A backoff
    stops at max(min_scale, FLOOR); a NaN scale never changes."""

    def __init__(self, scale, growth_factor, backoff_factor, growth_interval, hysteresis=1, min_scale=0.0,
                 max_scale=0.0, tracked=False):
        self.scale = f32(scale)
        self.gf, self.bf, self.interval = growth_factor, backoff_factor, growth_interval
        self.hysteresis, self.min_scale, self.max_scale, self.tracked = hysteresis, min_scale, max_scale, tracked
        self.growth, self.left, self.skipped = 0, hysteresis, 0
        self.growths = self.backoffs = self.tolerated = self.min_clamps = self.max_clamps = self.inf_blocked = 0
        self.floor_clamps = 0

    def step(self, found: float) -> None:
        if found != 0.0 or math.isnan(found):
            self.skipped += 1
            self.growth = 0
            left = (self.left - 1) if self.tracked else 0  # no tracker: hysteresis 1
            if left > 0:
                self.left = left
                self.tolerated += 1
                return
            backed = self.scale * self.bf
            if backed < self.min_scale:
                self.min_clamps += 1
            if backed < FLOOR:
                self.floor_clamps += 1
            if not math.isnan(self.scale):  # NaN stays NaN
                self.scale = f32(max(backed, self.min_scale, FLOOR))
            self.left = self.hysteresis
            self.backoffs += 1
            return
        self.growth += 1
        if self.growth < self.interval:
            return
        grown = self.scale * self.gf
        if self.max_scale > 0 and grown > self.max_scale:
            grown = self.max_scale
            self.max_clamps += 1
        if math.isfinite(f32(grown)):
            self.scale = f32(grown)
            self.growths += 1
        else:
            self.inf_blocked += 1
        self.growth = 0
        self.left = self.hysteresis


class DeviceScaler:
    """The op's state tensors on ``device``, stepped like RefScaler."""

    def __init__(self, ref: RefScaler, device, skipped_start: int = 0):
        self.ref, self.device = ref, device
        self.scale = scalar(ref.scale, device)
        self.growth = torch.zeros(1, dtype=torch.int32, device=device)
        self.left = torch.full((1,), ref.hysteresis, dtype=torch.int32, device=device) if ref.tracked else None
        self.skipped = torch.full((1,), skipped_start, dtype=torch.int64, device=device)
        self.skipped_start = skipped_start
        self.found = scalar(0.0, device)

    def step(self, found: float, what: str) -> None:
        r = self.ref
        self.found.fill_(found)
        mixprec.update_scale_(self.scale, self.growth, self.found, r.gf, r.bf, r.interval, hysteresis=r.hysteresis,
                              hysteresis_tracker=self.left, skipped_steps=self.skipped, min_scale=r.min_scale,
                              max_scale=r.max_scale)
        r.step(found)
        state = (self.scale.item(), self.growth.item(), None if self.left is None else self.left.item(),
                 self.skipped.item(), self.found.item())
        want = (r.scale, r.growth, r.left if r.tracked else None, self.skipped_start + r.skipped, found)
        same_scale = state[0] == want[0] or (math.isnan(state[0]) and math.isnan(want[0]))
        assert same_scale and state[1:4] == want[1:4], \
            f"{what}: (scale, growth, hysteresis left, skipped) {state[:4]} != {want[:4]}"
        assert state[4] == want[4] or (math.isnan(state[4]) and math.isnan(found)), f"{what}: found_inf was written"


def overflow_pattern(rng, steps, interval, hysteresis, overflow_values=(1.0,)):
    """found_inf values in bursts: clean runs up to twice the growth interval, overflow runs up
    to one past the hysteresis, so every branch of the rule is reached."""
    p = []
    while len(p) < steps:
        p += [0.0] * rng.randint(0, 2 * interval)
        p += [rng.choice(overflow_values) for _ in range(rng.randint(1, hysteresis + 1))]
    return p[:steps]


def test_update_scale_equals_torch_amp_update_scale(device, rng):
    # Factors exactly representable in float32 (so float and double arithmetic agree); any
    # nonzero found_inf, NaN included, is an overflow for both.
    for trial in range(3):
        gf = 2.0 if trial == 0 else f32(rng.uniform(1.1, 4.0))
        bf = 0.5 if trial == 0 else f32(rng.uniform(0.05, 0.95))
        interval = rng.randint(1, 5)
        init = 2.0**120 if trial == 2 else 65536.0  # trial 2 meets the never-grow-into-inf guard
        ours, theirs = scalar(init, device), scalar(init, device)
        ours_g = torch.zeros(1, dtype=torch.int32, device=device)
        theirs_g = ours_g.clone()
        found = scalar(0.0, device)
        for s, v in enumerate(overflow_pattern(rng, 150, interval, 1, (1.0, 1.0, 2.0, math.nan, -1.0))):
            found.fill_(v)
            mixprec.update_scale_(ours, ours_g, found, gf, bf, interval)
            torch._amp_update_scale_(theirs, theirs_g, found, gf, bf, interval)
            theirs.clamp_(min=FLOOR)  # torch's rule with the floor (small random backoffs reach it)
            assert_bitwise_equal(ours.cpu(), theirs.cpu(), f"trial {trial} step {s}: scale")
            assert_bitwise_equal(ours_g.cpu(), theirs_g.cpu(), f"trial {trial} step {s}: growth_tracker")


def test_update_scale_equals_torch_for_factors_not_representable_in_float32(device, rng):
    # GradScaler(backoff_factor=0.3) passes a Python float; torch's result must be reproduced.
    gf, bf = 1.7, 0.3
    ours, theirs = scalar(3.0, device), scalar(3.0, device)
    ours_g = torch.zeros(1, dtype=torch.int32, device=device)
    theirs_g = ours_g.clone()
    found = scalar(0.0, device)
    for s, v in enumerate(overflow_pattern(rng, 100, 2, 1) + [1.0]):
        found.fill_(v)
        mixprec.update_scale_(ours, ours_g, found, gf, bf, 2)
        torch._amp_update_scale_(theirs, theirs_g, found, gf, bf, 2)
        assert_bitwise_equal(ours.cpu(), theirs.cpu(), f"step {s}: scale")


SCALE_CONFIGS = {
    # name: (growth_factor, backoff_factor, interval, hysteresis, min_scale, max_scale, init, tracked)
    "plain": (2.0, 0.5, 3, 1, 0.0, 0.0, 65536.0, False),
    "hysteresis_3": ("g", "b", 4, 3, 0.0, 0.0, 1024.0, True),
    "hysteresis_1_tracked": (2.0, 0.5, 2, 1, 0.0, 0.0, 1024.0, True),
    "min_scale": (2.0, 0.5, 2, 2, 1.0, 0.0, 8.0, True),
    "max_scale": ("g", "b", 1, 1, 0.0, 70000.5, 1000.0, False),
    "both_bounds": ("g", "b", 2, 2, 0.75, 3000.0, 1000.0, True),
    "near_inf": (4.0, "b", 1, 2, 0.0, 0.0, 2.0**124, True),
}


@pytest.mark.parametrize("config", sorted(SCALE_CONFIGS))
def test_update_scale_follows_the_rule(device, config, rng):
    gf, bf, interval, hyst, lo, hi, init, tracked = SCALE_CONFIGS[config]
    gf = f32(rng.uniform(1.1, 3.0)) if gf == "g" else gf
    bf = f32(rng.uniform(0.1, 0.9)) if bf == "b" else bf
    ref = RefScaler(init, gf, bf, interval, hyst, lo, hi, tracked)
    dev = DeviceScaler(ref, device)
    n = 0
    for v in overflow_pattern(rng, 120, interval, hyst):
        dev.step(v, f"{config} step {n}")
        n += 1

    def drive(found, done):  # keep stepping until the branch this config exists for has fired
        nonlocal n
        for _ in range(4000):
            if done():
                return
            dev.step(found, f"{config} step {n}")
            n += 1

    drive(1.0, lambda: ref.backoffs > 0)
    if hyst > 1:
        drive(1.0, lambda: ref.tolerated > 0)
    if lo > 0:
        drive(1.0, lambda: ref.min_clamps > 0)
    if hi > 0:
        # Random backoff factors once took the scale to 0 or to the smallest denormals, where
        # growth rounds back to the same value (seeds 15, 28, 31); the floor keeps it growable.
        drive(0.0, lambda: ref.max_clamps > 0)
    if config == "near_inf":
        drive(0.0, lambda: ref.inf_blocked > 0)
    drive(0.0, lambda: ref.growths + ref.inf_blocked > 0)
    assert ref.backoffs > 0 and ref.growths + ref.inf_blocked > 0
    assert hyst == 1 or ref.tolerated > 0
    assert lo == 0 or ref.min_clamps > 0
    assert hi == 0 or ref.max_clamps > 0
    assert config != "near_inf" or ref.inf_blocked > 0


def test_update_scale_never_grows_into_inf(device):
    scale = scalar(torch.finfo(torch.float32).max, device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    mixprec.update_scale_(scale, growth, scalar(0.0, device), 2.0, 0.5, 1)
    assert scale.item() == torch.finfo(torch.float32).max and growth.item() == 0


@pytest.mark.parametrize("min_scale", [0.0, 1e-40, 2.0**-100])
@pytest.mark.parametrize("tracked", [False, True])
def test_200_overflows_in_a_row_stop_at_the_floor_and_grow_back(device, min_scale, tracked, rng):
    # torch reaches 0 after 180 halvings of 65536 (inv_scale inf, NaN grads from then on); here the
    # scale stops at max(min_scale, 2^-126), a subnormal min_scale included, and grows back.
    bf = rng.choice([0.5, f32(rng.uniform(0.05, 0.5))])  # 200 backoffs reach 2^-126 from 65536
    ref = RefScaler(65536.0, 2.0, bf, 3, 2 if tracked else 1, min_scale=min_scale, tracked=tracked)
    dev = DeviceScaler(ref, device)
    for s in range(200 * ref.hysteresis):  # 200 backoffs
        dev.step(1.0, f"overflow {s}")
    floor = f32(max(min_scale, FLOOR))
    assert dev.scale.item() == floor and floor > 0 and ref.floor_clamps + ref.min_clamps > 0
    assert math.isfinite(1.0 / dev.scale.item())
    for s in range(3):
        dev.step(0.0, f"clean {s}")
    assert dev.scale.item() == f32(floor * 2.0)


@pytest.mark.parametrize("start", [math.nan, 0.0, -0.0, math.inf])
def test_nan_scale_stays_nan_and_zero_or_inf_scales_follow_the_rule(device, start, rng):
    # NaN: every branch leaves it NaN (torch keeps it too; it used to become 0). 0 and -0 back off
    # to the floor, where growth works again; inf stays inf (its inverse 0 is flagged upstream).
    ref = RefScaler(start, 2.0, 0.5, 2, 2, tracked=True)
    dev = DeviceScaler(ref, device)
    for s, v in enumerate(overflow_pattern(rng, 40, 2, 2, (1.0, math.nan))):
        dev.step(v, f"start {start} step {s}")  # compares every field with the reference
        if math.isnan(start):
            assert math.isnan(dev.scale.item())
    if start == 0.0:
        assert ref.floor_clamps > 0 and dev.scale.item() >= FLOOR


@pytest.mark.parametrize("tracked", [False, True])
def test_skipped_steps_counts_every_overflow(device, tracked, rng):
    # Starts past 2^32 so that a 32-bit counter or an overwrite (instead of += 1) shows.
    ref = RefScaler(1024.0, 2.0, 0.5, 3, 2 if tracked else 1, tracked=tracked)
    dev = DeviceScaler(ref, device, skipped_start=2**33 + 5)
    pattern = overflow_pattern(rng, 60, 3, 2)
    for s, v in enumerate(pattern):
        dev.step(v, f"step {s}")
    assert dev.skipped.item() == 2**33 + 5 + sum(v != 0 for v in pattern)


# ---- update_scale_: bad arguments -------------------------------------------------------------------


def _scale_args(device):
    # found_inf = 1 and trackers mid-way: a call that ran would change every state tensor.
    return dict(scale=scalar(1024.0, device), growth_tracker=torch.full((1,), 3, dtype=torch.int32, device=device),
                found_inf=scalar(1.0, device), growth_factor=2.0, backoff_factor=0.5, growth_interval=10,
                hysteresis=2, hysteresis_tracker=torch.ones(1, dtype=torch.int32, device=device),
                skipped_steps=torch.full((1,), 7, dtype=torch.int64, device=device), min_scale=0.0, max_scale=0.0)


def _tensor(dtype, n=1):
    return lambda a, d: torch.ones(n, dtype=dtype, device=d)


SCALE_BAD = {
    "scale_float64": ("scale", _tensor(torch.float64), TypeError),
    "scale_float16": ("scale", _tensor(torch.float16), TypeError),
    "scale_two_elements": ("scale", _tensor(torch.float32, 2), ValueError),
    "growth_tracker_float32": ("growth_tracker", _tensor(torch.float32), TypeError),
    "growth_tracker_int64": ("growth_tracker", _tensor(torch.int64), TypeError),
    "growth_tracker_empty": ("growth_tracker", _tensor(torch.int32, 0), ValueError),
    "hysteresis_tracker_float32": ("hysteresis_tracker", _tensor(torch.float32), TypeError),
    "hysteresis_tracker_int64": ("hysteresis_tracker", _tensor(torch.int64), TypeError),
    "skipped_steps_int32": ("skipped_steps", _tensor(torch.int32), TypeError),
    "skipped_steps_two_elements": ("skipped_steps", _tensor(torch.int64, 2), ValueError),
    "found_inf_float16": ("found_inf", _tensor(torch.float16), TypeError),
    "found_inf_bool": ("found_inf", _tensor(torch.bool), TypeError),
    "found_inf_two_elements": ("found_inf", _tensor(torch.float32, 2), ValueError),
    "growth_factor_zero": ("growth_factor", 0.0, ValueError),
    "growth_factor_negative": ("growth_factor", -2.0, ValueError),
    "growth_factor_nan": ("growth_factor", math.nan, ValueError),
    "backoff_factor_zero": ("backoff_factor", 0.0, ValueError),
    "backoff_factor_nan": ("backoff_factor", math.nan, ValueError),
    "growth_interval_zero": ("growth_interval", 0, ValueError),
    "growth_interval_negative": ("growth_interval", -3, ValueError),
    "growth_interval_over_int32": ("growth_interval", 2**31, ValueError),
    "hysteresis_zero": ("hysteresis", 0, ValueError),
    "hysteresis_over_int32": ("hysteresis", 2**31, ValueError),
    "hysteresis_without_tracker": ("hysteresis_tracker", None, ValueError),
    "min_scale_negative": ("min_scale", -1.0, ValueError),
    "min_scale_nan": ("min_scale", math.nan, ValueError),
    "max_scale_below_min_scale": ("max_scale", 0.5, ValueError),  # with min_scale = 1 below
    "max_scale_negative": ("max_scale", -4.0, ValueError),
    "max_scale_nan": ("max_scale", math.nan, ValueError),
}
SCALE_BAD["min_scale_inf"] = ("min_scale", math.inf, ValueError)
SCALE_BAD_CUDA = {
    "growth_tracker_on_cpu": "growth_tracker",
    "hysteresis_tracker_on_cpu": "hysteresis_tracker",
    "skipped_steps_on_cpu": "skipped_steps",
    "found_inf_on_cpu": "found_inf",
}


def _check_scale_rejects(device, arg, value, exc):
    a = _scale_args(device)
    if arg == "max_scale":
        a["min_scale"] = 1.0
    a[arg] = value(a, device) if callable(value) else value
    every = [a[k] for k in ("scale", "growth_tracker", "found_inf", "hysteresis_tracker", "skipped_steps")]
    check_rejected(lambda: mixprec.update_scale_(**a), every, exc, "update_scale_", arg, None, device)


@pytest.mark.parametrize(
    "case", sorted(SCALE_BAD)
)
def test_update_scale_rejects_bad_arguments_and_modifies_nothing(device, case):
    arg, value, exc = SCALE_BAD[case]
    _check_scale_rejects(device, arg, value, exc)


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(SCALE_BAD_CUDA))
def test_update_scale_rejects_wrong_device(case):
    arg = SCALE_BAD_CUDA[case]
    _check_scale_rejects("cuda", arg, lambda a, d: a[arg].cpu(), RuntimeError)
