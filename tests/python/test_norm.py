# Tests of mixprec.multi_tensor_norm (ord 2 and inf, total and per tensor) on CPU and CUDA against
# float64 references: edge sizes, many tensors, NaN/inf propagation, bad inputs, opcheck, graphs.
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
    check_rejected,
    inject_non_finite,
    mostly_one_dtype,
    random_tensor,
    random_tensors,
    snapshot,
    sync,
    unaligned_view,
)

OP = "multi_tensor_norm"
ORDS = (2.0, math.inf)
TOL = 1e-5  # fp32 accumulation against the exact (float64) norm of the same values


def reference(tensors, ord) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 norms of the values as stored (fp16/bf16 upcast exactly): total and per tensor.
    Nothing has norm 0 (torch's inf norm refuses an empty tensor; mixprec's contract is 0)."""
    def norm(x):
        return torch.linalg.vector_norm(x, ord) if x.numel() else torch.zeros((), dtype=torch.float64)

    flat = [t.detach().cpu().to(torch.float64).reshape(-1) for t in tensors]
    per = torch.tensor([norm(f).item() for f in flat], dtype=torch.float64)
    total = norm(torch.cat(flat)) if flat else torch.zeros((), dtype=torch.float64)
    return total, per


def assert_norms(tensors, ord, per_tensor, device, what=""):
    """Runs the op and checks shapes, dtype, device and values; inputs must stay bit-identical.
    ord=inf is exact (a max of exactly representable values), ord=2 within TOL."""
    before = snapshot(tensors)
    total, per = mixprec.multi_tensor_norm(tensors, ord, per_tensor)
    sync(device)
    assert_unchanged(before, tensors, f"{what} inputs")
    assert total.dtype == torch.float32 and total.shape == () and total.device.type == torch.device(device).type
    n = len(tensors) if per_tensor else 0
    assert per.dtype == torch.float32 and per.shape == (n,) and per.device.type == torch.device(device).type
    ref_total, ref_per = reference(tensors, ord)
    got = [("total", total.cpu(), ref_total)]
    if per_tensor:
        got += [(f"per_tensor[{i}]", per[i].cpu(), ref_per[i]) for i in range(n)]
    for name, value, ref in got:
        if not math.isfinite(ref.item()):  # inf stays inf, NaN stays NaN: never a finite number
            assert_bitwise_equal(value.isnan(), ref.isnan(), f"{what} {name}: {value.item()} vs {ref.item()}")
            assert value.item() == ref.item() or math.isnan(ref.item()), f"{what} {name}: {value.item()} vs {ref}"
        elif ord == math.inf:
            assert_bitwise_equal(value, ref.to(torch.float32), f"{what} {name} (ord=inf)")
        else:
            assert_rel_err(value, ref, TOL, f"{what} {name} (ord=2)")
    return total, per


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_norm_matches_float64(device, dtype, ord, per_tensor, gen, rng):
    tensors = random_tensors(boundary_sizes(rng), dtype, device, gen)
    tensors.append(random_tensor((3, CHUNK // 2 + 1), dtype, device, gen))  # 2-D, straddles a chunk
    view, _ = unaligned_view(CHUNK + 9, dtype, device, gen)  # odd offset: the unaligned path
    tensors.append(view)
    assert_norms(tensors, ord, per_tensor, device, str(dtype))


@pytest.mark.parametrize("ord", ORDS)
def test_norm_mixed_dtypes_and_magnitudes(device, ord, gen, rng):
    # Tensors differing by up to 12 orders of magnitude: small ones must still count.
    sizes = boundary_sizes(rng)
    tensors = []
    for i, n in enumerate(sizes):
        dtype = FLOAT_DTYPES[i % 3]
        span = 3 if dtype == torch.float16 else 6
        tensors.append(random_tensor(n, dtype, device, gen, 10.0 ** rng.uniform(-span, span)))
    assert_norms(tensors, ord, True, device)


@pytest.mark.parametrize("ord", ORDS)
def test_norm_is_deterministic(device, ord, gen, rng):
    tensors = random_tensors(boundary_sizes(rng), FLOAT_DTYPES, device, gen)
    a = mixprec.multi_tensor_norm(tensors, ord, True)
    b = mixprec.multi_tensor_norm(tensors, ord, True)
    assert_bitwise_equal(a[0], b[0], "total")
    assert_bitwise_equal(a[1], b[1], "per_tensor")


@pytest.mark.skipif(os.environ.get("MIXPREC_CPU_SIMD") == "0", reason="this run is on the portable path already")
def test_cpu_vector_and_portable_paths_agree_bitwise(gen, rng, tmp_path):
    # The AVX2/F16C norm keeps the portable code's 16 lanes and summation order and neither
    # contracts into FMAs, so one machine gives the same bits whichever path runs (the portable
    # one, forced by MIXPREC_CPU_SIMD=0, in a fresh process). Unaligned views take the same code.
    tensors = random_tensors(boundary_sizes(rng) + [15, 16, 17, 33], FLOAT_DTYPES, "cpu", gen)
    tensors += [unaligned_view(CHUNK + 9, d, "cpu", gen)[0] for d in FLOAT_DTYPES]
    torch.save(tensors, tmp_path / "in.pt")
    script = ("import sys, torch, mixprec; ts = torch.load(sys.argv[1]); "
              "torch.save([mixprec.multi_tensor_norm(ts, o, True) for o in (2.0, float('inf'))], sys.argv[2])")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], check=True,
                   env=dict(os.environ, MIXPREC_CPU_SIMD="0"), timeout=300)
    portable = torch.load(tmp_path / "out.pt")
    for (total, per), ord in zip(portable, (2.0, math.inf)):
        ours = mixprec.multi_tensor_norm(tensors, ord, True)
        assert_bitwise_equal(ours[0], total, f"ord {ord}: total")
        assert_bitwise_equal(ours[1], per, f"ord {ord}: per_tensor")


@pytest.mark.parametrize("value", NON_FINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("ord", ORDS)
def test_non_finite_propagates(device, ord, where, value, gen, rng):
    # The bad tensor straddles chunks and is surrounded by larger finite values, so a max that
    # drops NaN (fmax) or a reduction that skips a chunk would give a finite answer.
    dtype = rng.choice(FLOAT_DTYPES)
    sizes = [2 * CHUNK + rng.randint(1, 999), rng.randint(1, 100), CHUNK + 1]
    tensors = random_tensors(sizes, dtype, device, gen)
    k = rng.randrange(len(tensors))
    inject_non_finite(tensors[k], where, value, gen)
    tensors[(k + 1) % 3].view(-1)[0] = 1000.0
    total, per = assert_norms(tensors, ord, True, device, f"{dtype} tensors[{k}]")
    want = math.inf if not math.isnan(value) else math.nan
    assert math.isnan(total.item()) if math.isnan(want) else total.item() == want
    assert all(math.isfinite(per[i].item()) for i in range(3) if i != k)


@pytest.mark.parametrize("ord", ORDS)
def test_nan_beats_inf(device, ord, gen, rng):
    # Both in one list, in either order: the result is NaN (as torch's norm gives), never inf.
    for first in (math.inf, math.nan):
        tensors = random_tensors([CHUNK + 5, 77], torch.float32, device, gen)
        tensors[0].view(-1)[rng.randrange(CHUNK + 5)] = first
        tensors[1].view(-1)[rng.randrange(77)] = math.nan if first == math.inf else math.inf
        total, _ = assert_norms(tensors, ord, True, device)
        assert math.isnan(total.item())


def test_empty_list():
    # The norm of nothing is 0 (as for zero-size tensors); with no tensor
    # to say which device, the results are CPU tensors.
    for ord in ORDS:
        for per_tensor in (False, True):
            total, per = mixprec.multi_tensor_norm([], ord, per_tensor)
            assert total.dtype == torch.float32 and total.shape == () and total.item() == 0.0
            assert per.dtype == torch.float32 and per.shape == (0,)


@pytest.mark.parametrize("ord", ORDS)
def test_zero_size_tensors(device, ord, gen):
    tensors = [random_tensor(s, FLOAT_DTYPES[i % 3], device, gen)
               for i, s in enumerate([(0,), (CHUNK + 1,), (0, 5), (3,), (4, 0, 2)])]
    _, per = assert_norms(tensors, ord, True, device)
    assert per[0].item() == per[2].item() == per[4].item() == 0.0
    only_empty = [torch.empty(0, device=device), torch.empty(3, 0, dtype=torch.float16, device=device)]
    total, per = assert_norms(only_empty, ord, True, device)
    assert total.item() == 0.0 and per.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("ord", ORDS)
def test_more_tensors_than_one_launch_table_holds(device, ord, gen, rng):
    sizes = [rng.randint(1, 40) for _ in range(MANY_TENSORS)]
    for i in rng.sample(range(MANY_TENSORS), 3):
        sizes[i] = CHUNK + rng.randint(1, 100)
    for i in rng.sample(range(MANY_TENSORS), 5):
        sizes[i] = 0
    # Every tensor gets its own magnitude, so a per-tensor result written to the wrong index shows.
    dtypes = mostly_one_dtype(MANY_TENSORS, rng)
    tensors = [random_tensor(n, dtypes[i], device, gen, 2.0 ** rng.randint(-6, 6)) for i, n in enumerate(sizes)]
    total, per = mixprec.multi_tensor_norm(tensors, ord, True)
    ref_total, ref_per = reference(tensors, ord)
    if ord == math.inf:
        assert_bitwise_equal(per.cpu(), ref_per.to(torch.float32), "per_tensor")
        assert_bitwise_equal(total.cpu(), ref_total.to(torch.float32), "total")
    else:
        rel = ((per.cpu().double() - ref_per).abs() / ref_per.clamp_min(1e-30)).max().item()
        assert rel < TOL, f"worst per-tensor relative error {rel:.3e}"
        assert_rel_err(total, ref_total, TOL, "total")
    # And without per-tensor norms: the total alone, through the same launches.
    total2, per2 = mixprec.multi_tensor_norm(tensors, ord, False)
    assert per2.shape == (0,)
    assert_bitwise_equal(total2.cpu(), total.cpu(), "total without per_tensor")


@given(
    shapes=st.lists(
        st.one_of(
            st.sampled_from([(0,), (1,), (2,), (15,), (17,), (CHUNK - 1,), (CHUNK,), (CHUNK + 1,)]),
            st.tuples(st.integers(0, 300)),
            st.tuples(st.integers(0, 40), st.integers(0, 40)),
        ),
        min_size=1,
        max_size=8,
    ),
    dtypes=st.lists(st.sampled_from(FLOAT_DTYPES), min_size=1, max_size=3),
    ord=st.sampled_from(ORDS),
    per_tensor=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_norm_random_lists(device, shapes, dtypes, ord, per_tensor, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [random_tensor(s, dtypes[i % len(dtypes)], device, gen) for i, s in enumerate(shapes)]
    assert_norms(tensors, ord, per_tensor, device)


# ---- bad inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ord", [1.0, 0.0, 3.0, -2.0, -math.inf, math.nan])
def test_bad_ord_is_rejected(device, ord, gen):
    tensors = random_tensors([5, 7], torch.float32, device, gen)
    check_rejected(lambda: mixprec.multi_tensor_norm(tensors, ord), tensors, ValueError, OP, "ord", None, device)


def _nc(device):
    return torch.ones(3, 8, device=device)[:, ::2]  # skips memory: no linear walk reads it


@pytest.mark.parametrize("per_tensor", [False, True])
def test_dense_strided_tensors_take_their_norms(device, per_tensor, gen):
    """Transposed and channels_last tensors are dense: summed in storage order, their norms are
    those of their contiguous copies (float64 reference)."""
    base = random_tensors([(CHUNK // 64 + 3, 67), (3, 5, 7, 2), (9, 4)], FLOAT_DTYPES, device, gen)
    tensors = [base[0].t(), base[1].contiguous(memory_format=torch.channels_last), base[2]]
    assert not tensors[0].is_contiguous() and not tensors[1].is_contiguous()
    for ord in ORDS:
        total, per = mixprec.multi_tensor_norm(tensors, ord, per_tensor)
        ref = [torch.linalg.vector_norm(t.double().flatten(), ord) for t in tensors]
        assert_rel_err(total, torch.linalg.vector_norm(torch.stack(ref), ord), 1e-6, f"total, ord {ord}")
        if per_tensor:
            assert_rel_err(per, torch.stack(ref), 1e-6, f"per tensor, ord {ord}")


NORM_BAD = {
    "float64": (lambda d: torch.ones(7, dtype=torch.float64, device=d), TypeError),
    "int32": (lambda d: torch.ones(7, dtype=torch.int32, device=d), TypeError),
    "bool": (lambda d: torch.ones(7, dtype=torch.bool, device=d), TypeError),
    "complex64": (lambda d: torch.ones(7, dtype=torch.complex64, device=d), TypeError),
    "non_contiguous": (_nc, RuntimeError),
}


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("case", sorted(NORM_BAD))
def test_bad_tensor_is_rejected_by_index(device, case, per_tensor, gen):
    make, exc = NORM_BAD[case]
    tensors = random_tensors([5, CHUNK + 1], FLOAT_DTYPES, device, gen) + [make(device)]
    check_rejected(lambda: mixprec.multi_tensor_norm(tensors, 2.0, per_tensor), tensors, exc, OP, "tensors", 2,
                   device)


@pytest.mark.cuda
def test_tensor_on_another_device_is_rejected_by_index(gen):
    tensors = random_tensors([5, CHUNK + 1], FLOAT_DTYPES, "cuda", gen) + [torch.ones(4)]
    check_rejected(lambda: mixprec.multi_tensor_norm(tensors, 2.0, True), tensors, RuntimeError, OP, "tensors", 2,
                   "cuda")


# ---- dispatcher, torch.compile and CUDA graphs ----------------------------------------------------------


def test_opcheck(device, gen):
    op = torch.ops.mixprec.multi_tensor_norm.default
    tensors = random_tensors([CHUNK + 3, 10, 0, 1], FLOAT_DTYPES, device, gen)
    for ord in ORDS:
        for per_tensor in (False, True):
            torch.library.opcheck(op, (tensors, ord, per_tensor))


@pytest.mark.cuda
def test_cuda_norm_never_syncs_and_captures_in_a_cuda_graph(gen):
    device = "cuda"
    tensors = random_tensors([CHUNK + 3, 100, 0, 2 * CHUNK], FLOAT_DTYPES, device, gen)
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization inside the op raises
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
            for ord in ORDS:
                mixprec.multi_tensor_norm(tensors, ord, True)
        torch.cuda.current_stream().wait_stream(side)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2 = mixprec.multi_tensor_norm(tensors, 2.0, True)
        linf = mixprec.multi_tensor_norm(tensors, math.inf, True)
    for trial in range(2):
        for t in tensors:  # new values in the captured buffers
            t.copy_(random_tensor(t.shape, t.dtype, device, gen, 2.0 ** (3 * trial)))
        graph.replay()
        torch.cuda.synchronize()
        for ord, (total, per) in ((2.0, l2), (math.inf, linf)):
            ref_total, ref_per = reference(tensors, ord)
            assert_rel_err(total, ref_total, TOL, f"replay {trial} ord={ord} total")
            assert_rel_err(per, ref_per, TOL, f"replay {trial} ord={ord} per_tensor")
