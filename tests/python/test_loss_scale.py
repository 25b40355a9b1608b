# Tests of the loss-scaling ops non_finite_check_and_unscale_ and scale_ on CPU and CUDA (update_scale_'s
# rule: test_update_scale.py): float64 and bitwise references, torch's _amp_* ops, inf/NaN, bad inputs.
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mixprec
from conftest import (
    CHUNK,
    FLOAT_DTYPES,
    MANY_TENSORS,
    NON_FINITE,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    boundary_sizes,
    inject_non_finite,
    mostly_one_dtype,
    peer_bound,
    poisoned_like,
    random_tensor,
    random_tensors,
    scalar,
    snapshot,
    sync,
    unaligned_view,
)

OP = "non_finite_check_and_unscale_"
MODES = ("in_place", "out", "check")
GRAD_SCALE = 1000.0  # gradients as a loss scaler sees them: scaled up


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even; inf on overflow)."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


def random_inv_scale(rng) -> float:
    # Not a power of two, so the product really rounds and a wrong rounding shows.
    return f32(1.0 / rng.uniform(700.0, 1300.0))


def expected_unscaled(before: torch.Tensor, inv: float | None, dtype: torch.dtype) -> torch.Tensor:
    """What the op must write: one fp32 product, rounded once to ``dtype`` (as torch computes)."""
    x = before.detach().cpu().to(torch.float32)
    if inv is not None:
        x = x * torch.tensor(inv, dtype=torch.float32)
    return x.to(dtype)


def assert_unscaled(out: torch.Tensor, before: torch.Tensor, inv: float | None, what: str) -> None:
    """Bitwise equal to plain PyTorch's fp32 arithmetic (NaN payloads aside), and within
    docs/architecture.md's bound of the float64 product where the input was finite."""
    expected = expected_unscaled(before, inv, out.dtype)
    assert_bitwise_equal(out.detach().cpu(), expected, what, nan_equal=True)
    b = before.detach().cpu()
    finite = b.isfinite()  # non-finite positions are zeroed on both sides (cheaper than masking)
    ref64 = torch.where(finite, b.to(torch.float64) * (1.0 if inv is None else inv), 0.0)
    o = torch.where(finite, out.detach().cpu().to(torch.float64), 0.0)
    peer = torch.where(finite, expected.to(torch.float64), 0.0)
    assert_rel_err(o, ref64, peer_bound(out.dtype, peer, ref64), what)


def one_hot(n: int, hot, device) -> torch.Tensor:
    t = torch.zeros(n, dtype=torch.float32)
    t[list(hot)] = 1.0
    return t.to(device)


class Unscale:
    """One call of the op in a given mode over ``grads``, with every checkable output."""

    def __init__(self, mode: str, grads, device, inv: float | None, out_dtypes=None):
        self.mode, self.grads, self.device, self.inv = mode, grads, device, inv
        self.before = snapshot(grads)
        self.found_inf = scalar(0.0, device)
        self.per_tensor = torch.zeros(len(grads), device=device)
        self.out: list[torch.Tensor] = []
        if mode == "out":
            dts = out_dtypes or [torch.float32] * len(grads)
            self.out = [poisoned_like(g, dts[i % len(dts)]) for i, g in enumerate(grads)]
        if mode == "check":
            self.inv = None

    def run(self):
        inv = None if self.inv is None else scalar(self.inv, self.device)
        mixprec.non_finite_check_and_unscale_(self.grads, self.found_inf, inv, self.out, self.per_tensor)
        sync(self.device)
        return self

    def check(self, bad_indices=()) -> None:
        bad = sorted(set(bad_indices))
        assert self.found_inf.item() == (1.0 if bad else 0.0), f"{self.mode}: found_inf, bad tensors {bad}"
        assert_bitwise_equal(self.per_tensor.cpu(), one_hot(len(self.grads), bad, "cpu"),
                             f"{self.mode}: per_tensor_found")
        if self.mode == "in_place":
            assert_all_unscaled(self.grads, self.before, self.inv, "in place grads")
        else:
            assert_unchanged(self.before, self.grads, f"{self.mode}: grads")
            assert_all_unscaled(self.out, self.before, self.inv, "out")


def assert_all_unscaled(outs, befores, inv, what: str) -> None:
    """assert_unscaled over lists, one comparison per dtype pair (thousands of tiny tensors stay
    fast); on a failure the tensors are checked one by one so that the message names the index."""
    groups: dict = {}
    for i, (o, b) in enumerate(zip(outs, befores)):
        groups.setdefault((b.dtype, o.dtype), []).append(i)
    for (bd, od), idx in groups.items():
        try:
            assert_unscaled(torch.cat([outs[i].detach().reshape(-1) for i in idx]),
                            torch.cat([befores[i].reshape(-1) for i in idx]), inv, f"{what} ({bd} -> {od})")
        except AssertionError:
            for i in idx:
                assert_unscaled(outs[i], befores[i], inv, f"{what}[{i}] ({bd} -> {od})")
            raise


# ---- non_finite_check_and_unscale_: values -------------------------------------------------------


def test_unscale_in_place_mixed_dtypes_and_boundary_sizes(device, gen, rng):
    sizes = boundary_sizes(rng)
    grads = random_tensors(sizes, FLOAT_DTYPES, device, gen, GRAD_SCALE)
    view, base = unaligned_view(CHUNK + 1, torch.float16, device, gen, GRAD_SCALE)  # unaligned path
    base_before = base.clone()
    grads.append(view)
    grads.append(random_tensor((3, CHUNK // 2 + 1), torch.bfloat16, device, gen, GRAD_SCALE))  # 2-D
    u = Unscale("in_place", grads, device, random_inv_scale(rng)).run()
    u.check()
    assert_bitwise_equal(base[[0, -1]].cpu(), base_before[[0, -1]].cpu(), "wrote outside an offset view")


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES, ids=str)
def test_unscale_into_out_of_another_dtype(device, in_dtype, out_dtype, gen, rng):
    # fp16 -> fp32 master grads is the main use; every pair must work, every element be written
    # (outputs are NaN-poisoned), grads stay bit-identical, also when an inf is found.
    sizes = boundary_sizes(rng)
    grads = random_tensors(sizes, in_dtype, device, gen, GRAD_SCALE)
    bad = rng.randrange(len(grads))
    inject_non_finite(grads[bad], "random", rng.choice(NON_FINITE), gen)
    u = Unscale("out", grads, device, random_inv_scale(rng), [out_dtype])
    view, base = unaligned_view(CHUNK + 7, out_dtype, device, gen)
    base.fill_(math.nan)
    u.grads.append(random_tensor(CHUNK + 7, in_dtype, device, gen, GRAD_SCALE))
    u.before.append(u.grads[-1].clone())
    u.out.append(view)
    u.per_tensor = torch.zeros(len(u.grads), device=device)
    u.run().check([bad])
    assert bool(base[[0, -1]].isnan().all()), "wrote outside an offset out view"


def test_unscale_into_out_with_mixed_dtypes_in_both_lists(device, gen, rng):
    sizes = boundary_sizes(rng)
    grads = random_tensors(sizes, FLOAT_DTYPES, device, gen, GRAD_SCALE)
    out_dtypes = [rng.choice(FLOAT_DTYPES) for _ in sizes]
    Unscale("out", grads, device, random_inv_scale(rng), out_dtypes).run().check()


def test_out_without_inv_scale_is_a_plain_conversion(device, gen, rng):
    grads = random_tensors([CHUNK + 1, 333, CHUNK], FLOAT_DTYPES, device, gen, GRAD_SCALE)
    u = Unscale("out", grads, device, None, [torch.float16, torch.float32, torch.bfloat16]).run()
    u.check()


def test_check_only_writes_nothing(device, gen, rng):
    sizes = boundary_sizes(rng)
    grads = random_tensors(sizes, FLOAT_DTYPES, device, gen, GRAD_SCALE)
    Unscale("check", grads, device, None).run().check()  # clean: found stays 0, grads bitwise
    bad = rng.sample(range(len(grads)), 2)
    for i in bad:
        inject_non_finite(grads[i], "random", rng.choice(NON_FINITE), gen)
    Unscale("check", grads, device, None).run().check(bad)


@pytest.mark.parametrize("value", NON_FINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_non_finite_found_at_every_position(device, dtype, where, value, gen, rng):
    # The bad tensor straddles chunks, so "last" and most "random" positions sit past chunk 0.
    sizes = [2 * CHUNK + rng.randint(1, 999), rng.randint(1, 100)]
    clean = random_tensors(sizes, dtype, device, gen, GRAD_SCALE)
    k = rng.randrange(len(sizes))
    inject_non_finite(clean[k], where, value, gen)
    for mode in MODES:
        grads = [g.clone() for g in clean]
        Unscale(mode, grads, device, random_inv_scale(rng), [torch.float32]).run().check([k])


def test_found_inf_is_sticky_and_checks_inputs_not_products(device):
    # found_inf is only ever set, never cleared (torch's contract: one flag over several calls).
    grads = [torch.ones(5, device=device)]
    found = scalar(1.0, device)
    mixprec.non_finite_check_and_unscale_(grads, found, scalar(0.5, device))
    assert found.item() == 1.0
    # A finite input whose product overflows the output type is not an overflow of the
    # gradients (torch tests before scaling too): found_inf stays 0, the output holds inf.
    g = torch.full((17,), 60000.0, dtype=torch.float16, device=device)
    found = scalar(0.0, device)
    mixprec.non_finite_check_and_unscale_([g], found, scalar(4.0, device))
    assert found.item() == 0.0 and bool(g.isinf().all())
    g32 = torch.full((9,), 1e6, device=device)
    out = [poisoned_like(g32, torch.float16)]
    mixprec.non_finite_check_and_unscale_([g32], found, None, out)
    assert found.item() == 0.0 and bool((out[0] == math.inf).all())


@pytest.mark.skipif(os.environ.get("MIXPREC_CPU_SIMD") == "0", reason="this run is on the portable path already")
def test_portable_cpu_path_passes_the_exactness_tests():
    # The CPU kernels pick AVX2/F16C code at run time; aarch64 and older x86-64 CPUs run the
    # portable code instead. MIXPREC_CPU_SIMD=0 forces that code, so rerun the bitwise and
    # inf/NaN tests of the unscale and the norm under it, in a fresh process (the choice is made
    # once per process).
    here = os.path.dirname(os.path.abspath(__file__))
    selected = ("every_16_bit or 16_bit_pattern or rounds_to_nearest or equals_torch_amp or found_at_every_position"
                " or boundary_sizes or into_out_of_another_dtype or matches_float64 or non_finite_propagates"
                " or nan_beats_inf or is_deterministic")
    files = [os.path.join(here, f) for f in ("test_loss_scale.py", "test_loss_scale_bits.py", "test_norm.py")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", f"cpu and ({selected})"]
    r = subprocess.run(cmd, env=dict(os.environ, MIXPREC_CPU_SIMD="0"), cwd=here, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"portable path failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout and "no tests ran" not in r.stdout, r.stdout[-2000:]


@given(
    specs=st.lists(
        st.tuples(
            st.one_of(
                st.sampled_from([(0,), (1,), (2,), (15,), (17,), (CHUNK - 1,), (CHUNK,), (CHUNK + 1,)]),
                st.tuples(st.integers(0, 300)),
                st.tuples(st.integers(0, 40), st.integers(0, 40)),
            ),
            st.sampled_from(FLOAT_DTYPES),
            st.sampled_from(FLOAT_DTYPES),
            st.sampled_from([None, "first", "last", "random"]),
            st.sampled_from(NON_FINITE),
        ),
        max_size=8,
    ),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**32 - 1),
)
def test_unscale_random_lists(device, specs, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [random_tensor(shape, dt, device, gen, GRAD_SCALE) for shape, dt, *_ in specs]
    bad = []
    for i, (shape, _, _, where, value) in enumerate(specs):
        if where is not None and grads[i].numel() > 0:
            inject_non_finite(grads[i], where, value, gen)
            bad.append(i)
    inv = f32(1.0 / (700.0 + 600.0 * torch.rand((), generator=gen).item()))
    Unscale(mode, grads, device, inv, [s[2] for s in specs] or None).run().check(bad)


@pytest.mark.parametrize("mode", MODES)
def test_more_tensors_than_one_launch_table_holds(device, mode, gen, rng):
    sizes = [rng.randint(1, 40) for _ in range(MANY_TENSORS)]
    for i in rng.sample(range(MANY_TENSORS), 3):
        sizes[i] = CHUNK + rng.randint(1, 100)  # a few multi-chunk tensors among them
    for i in rng.sample(range(MANY_TENSORS), 5):
        sizes[i] = 0
    grads = random_tensors(sizes, mostly_one_dtype(MANY_TENSORS, rng), device, gen, GRAD_SCALE)
    out_dtypes = mostly_one_dtype(MANY_TENSORS, rng)
    u = Unscale(mode, grads, device, random_inv_scale(rng), out_dtypes)
    u.run().check()
    # Flags from tensors in later launches must land at their own index.
    nonempty = [i for i, s in enumerate(sizes) if s > 0]
    bad = {nonempty[0], nonempty[-1]} | set(rng.sample(nonempty, 4))
    grads = [g.clone() for g in grads]
    for i in bad:
        inject_non_finite(grads[i], "random", rng.choice(NON_FINITE), gen)
    u = Unscale(mode, grads, device, random_inv_scale(rng), out_dtypes)
    u.run().check(bad)


def test_empty_list(device):
    found, inv = scalar(0.0, device), scalar(0.25, device)
    mixprec.non_finite_check_and_unscale_([], found, inv)
    mixprec.non_finite_check_and_unscale_([], found, None, [], torch.zeros(0, device=device))
    mixprec.scale_([], inv)
    sync(device)
    assert found.item() == 0.0 and inv.item() == 0.25
    found.fill_(1.0)
    mixprec.non_finite_check_and_unscale_([], found, inv)
    assert found.item() == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_zero_size_tensors(device, mode, gen, rng):
    shapes = [(0,), (CHUNK + 1,), (0, 5), (3,), (5, 0, 2), (CHUNK,)]
    grads = [random_tensor(s, FLOAT_DTYPES[i % 3], device, gen, GRAD_SCALE) for i, s in enumerate(shapes)]
    inject_non_finite(grads[3], "last", math.nan, gen)
    Unscale(mode, grads, device, random_inv_scale(rng), [torch.float16, torch.float32]).run().check([3])
    only_empty = [torch.empty(0, device=device), torch.empty(4, 0, device=device, dtype=torch.float16)]
    Unscale(mode, only_empty, device, random_inv_scale(rng)).run().check()


def test_scale_multiplies_in_place(device, gen, rng):
    # scale_ is gradient clipping's multiply by a device coefficient; non-finite values are
    # scaled like any other and raise nothing.
    grads = random_tensors(boundary_sizes(rng), FLOAT_DTYPES, device, gen)
    inject_non_finite(grads[0], "first", math.inf, gen)
    before = snapshot(grads)
    coef = f32(rng.uniform(0.05, 0.95))
    mixprec.scale_(grads, scalar(coef, device))
    for i, (g, b) in enumerate(zip(grads, before)):
        assert_unscaled(g, b, coef, f"scale_ tensors[{i}]")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_unscale_equals_torch_amp_foreach(device, dtype, gen, rng):
    sizes = boundary_sizes(rng)
    for trial in range(3):
        ours = random_tensors(sizes, dtype, device, gen, GRAD_SCALE)
        if trial == 1:  # non-finite values, and finite ones whose product overflows
            for i in rng.sample(range(len(ours)), 3):
                inject_non_finite(ours[i], rng.choice(["first", "last", "random"]), rng.choice(NON_FINITE), gen)
            ours.append(torch.full((33,), torch.finfo(dtype).max, dtype=dtype, device=device))
        theirs = [g.clone() for g in ours]
        inv = random_inv_scale(rng) if trial != 1 else 2.0
        found_ours = scalar(1.0 if trial == 2 else 0.0, device)  # trial 2: found_inf already set
        found_theirs = found_ours.clone()
        mixprec.non_finite_check_and_unscale_(ours, found_ours, scalar(inv, device))
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, scalar(inv, device))
        except NotImplementedError:  # torch's CUDA op has no bfloat16 kernel: its CPU op is the reference
            theirs, found_theirs = [t.cpu() for t in theirs], found_theirs.cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, scalar(inv, "cpu"))
        assert_bitwise_equal(found_ours.cpu(), found_theirs.cpu(), f"trial {trial}: found_inf")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_bitwise_equal(a.cpu(), b.cpu(), f"trial {trial}: grads[{i}]", nan_equal=True)


# ---- dispatcher, torch.compile and CUDA graphs ---------------------------------------------------------


def test_opcheck_non_finite_check_and_unscale(device, gen):
    # opcheck runs the op several times (real, fake, functionalized) and compares the mutations.
    op = torch.ops.mixprec.non_finite_check_and_unscale_.default
    for mode in ("in_place", "out", "check", "scale_only"):
        grads = random_tensors([CHUNK + 3, 10, 1], FLOAT_DTYPES, device, gen, GRAD_SCALE)
        inject_non_finite(grads[1], "random", math.inf, gen)
        found = None if mode == "scale_only" else scalar(0.0, device)
        inv = None if mode == "check" else scalar(0.5, device)
        out = [torch.empty_like(g, dtype=torch.float32) for g in grads] if mode == "out" else []
        per = torch.zeros(3, device=device) if mode in ("in_place", "check") else None
        torch.library.opcheck(op, (grads, found, inv, out, per))


def test_opcheck_update_scale(device):
    op = torch.ops.mixprec.update_scale_.default
    for found, tracked in ((1.0, True), (0.0, False), (1.0, False)):
        args = (scalar(1024.0, device), torch.full((1,), 2, dtype=torch.int32, device=device),
                torch.full((1,), 2, dtype=torch.int32, device=device) if tracked else None,
                torch.zeros(1, dtype=torch.int64, device=device) if tracked else None,
                scalar(found, device), 2.0, 0.5, 3, 2 if tracked else 1, 1.0, 2.0**20)
        torch.library.opcheck(op, args)


@pytest.mark.cuda
def test_cuda_ops_never_sync_and_capture_in_a_cuda_graph(gen):
    device = "cuda"
    grads = random_tensors([CHUNK + 3, 100, 5], FLOAT_DTYPES, device, gen, GRAD_SCALE)
    master = [poisoned_like(g, torch.float32) for g in grads]
    found, inv = scalar(0.0, device), scalar(1.0 / 1024, device)
    scale = scalar(1024.0, device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    left = torch.full((1,), 2, dtype=torch.int32, device=device)
    skipped = torch.zeros(1, dtype=torch.int64, device=device)

    def step():
        found.zero_()
        mixprec.non_finite_check_and_unscale_(grads, found, inv, master)
        mixprec.update_scale_(scale, growth, found, 2.0, 0.5, 3, hysteresis=2, hysteresis_tracker=left,
                              skipped_steps=skipped)

    torch.cuda.set_sync_debug_mode("error")  # any host synchronization inside the ops raises
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
            step()
        torch.cuda.current_stream().wait_stream(side)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay(expect_found, expect_scale, expect_growth, expect_left, expect_skipped, what):
        before = snapshot(grads)
        for m in master:
            m.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert found.item() == expect_found, what
        assert (scale.item(), growth.item(), left.item(), skipped.item()) == (
            expect_scale, expect_growth, expect_left, expect_skipped), what
        for i, (m, b) in enumerate(zip(master, before)):
            assert_unscaled(m, b, inv.item(), f"{what}: master[{i}]")

    scale.fill_(1024.0)
    growth.zero_()
    left.fill_(2)
    skipped.zero_()
    replay(0.0, 1024.0, 1, 2, 0, "clean replay")
    inv.fill_(1.0 / 512)  # the graph reads inv_scale from the device, not a captured constant
    for g in grads:
        g.copy_(random_tensor(g.shape, g.dtype, device, gen, GRAD_SCALE))
    replay(0.0, 1024.0, 2, 2, 0, "new data and inv_scale")
    grads[1][7] = math.inf
    replay(1.0, 1024.0, 0, 1, 1, "overflow tolerated by hysteresis")
    replay(1.0, 512.0, 0, 2, 2, "overflow backs off")
