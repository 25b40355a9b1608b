# Shared fixtures and helpers for mixprec's Python tests: devices (CUDA skipped without a GPU),
# fresh seeded random inputs, float64 error metrics, inf/NaN injection, poisoning, bitwise checks.
from __future__ import annotations

import math
import os
import random
import re
import sys
from typing import Callable, Iterable, Sequence

import pytest
import torch

try:
    from hypothesis import HealthCheck, settings

    # Bounded by default so the whole suite stays fast on 2 CPU cores; no example database, so
    # runs leave no files in the checkout. MIXPREC_HYPOTHESIS_PROFILE=thorough digs deeper.
    _common = dict(
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile("mixprec", max_examples=15, **_common)
    settings.register_profile("thorough", max_examples=300, **_common)
    settings.load_profile(os.environ.get("MIXPREC_HYPOTHESIS_PROFILE", "mixprec"))
except ImportError:  # hypothesis is a test dependency; tests that need it import it themselves
    pass

# PyPI's torchvision is built for a CUDA torch and cannot load beside CI's CPU-only torch, which
# breaks `import timm` and `import lightning` (through torchmetrics): import it once, the way
# benchmarks/real_models_zoo.py does, before any test module imports those.
BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
import real_models_zoo  # noqa: E402

real_models_zoo.import_torchvision()
# The same, for a subprocess that runs examples (tests/python/test_docs_examples.py).
TORCHVISION_FIX = (f"import sys; sys.path.insert(0, {BENCHMARKS!r}); import real_models_zoo; "
                   "real_models_zoo.import_torchvision()")

# ---- constants mirrored from the kernel tier (csrc/kernels/multi_tensor*.h) -----------------

#: Elements per chunk (kernels::kChunkElems): sizes around its multiples straddle chunk boundaries.
CHUNK = 65536
#: More tensors than any one CUDA launch table holds (1094 entries with one list, 857 with two).
#: Tables are filled per dtype group, so most of these tensors must share their dtypes.
MANY_TENSORS = 2000
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Dtypes the multi-tensor ops must reject.
BAD_DTYPES = (torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64)

# ---- devices ----------------------------------------------------------------------------------

#: Use as ``@pytest.mark.parametrize("device", DEVICES)``; the cuda case carries the cuda marker.
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


def cuda_available() -> bool:
    # Asks the driver for a device count only; creates no context.
    return torch.cuda.is_available()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not cuda_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every test taking ``device`` runs on the CPU and, marked ``cuda``, on the GPU."""
    return request.param


def sync(device) -> None:
    """Waits for queued kernels, so that errors and results belong to the op under test."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- randomness: fresh every run, reproducible on demand --------------------------------------


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (or MIXPREC_TEST_SEED), printed so a failure can be replayed."""
    env = os.environ.get("MIXPREC_TEST_SEED")
    s = int(env) if env else int.from_bytes(os.urandom(4), "little")
    print(f"MIXPREC_TEST_SEED={s}  ({request.node.nodeid})")
    return s


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU generator; inputs are drawn on the CPU and moved, so CPU and CUDA see the same data."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def rng(seed) -> random.Random:
    return random.Random(seed)


def scalar(value: float, device, dtype=torch.float32) -> torch.Tensor:
    """A one-element device tensor, as the ops take scales, flags and learning rates."""
    return torch.full((1,), value, dtype=dtype, device=device)


def random_tensor(shape, dtype, device, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random values with random signs and magnitudes in [0.25, 4) * scale: never zero, so a
    kernel that skips an element or writes zeros cannot pass by accident."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    x = torch.rand(shape, generator=gen).mul_(4).sub_(2).exp2_()
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.bool)
    return torch.where(sign, -x, x).mul_(scale).to(dtype).to(device)


def random_tensors(sizes: Iterable, dtypes, device, gen: torch.Generator, scale: float = 1.0) -> list[torch.Tensor]:
    """One tensor per size; ``dtypes`` is one dtype or a sequence cycled over the list."""
    dtypes = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
    return [random_tensor(s, dtypes[i % len(dtypes)], device, gen, scale) for i, s in enumerate(sizes)]


def mostly_one_dtype(n: int, rng: random.Random, others: int = 40) -> list[torch.dtype]:
    """``n`` dtypes: one random main dtype (so one dtype group exceeds a launch table) with
    ``others`` random positions of other dtypes mixed in."""
    main = rng.choice(FLOAT_DTYPES)
    dtypes = [main] * n
    for i in rng.sample(range(n), min(others, n)):
        dtypes[i] = rng.choice([d for d in FLOAT_DTYPES if d != main])
    return dtypes


def boundary_sizes(rng: random.Random) -> list[int]:
    """Sizes around one, two and four chunks (a persistent block walks several chunks, and a
    16-byte word path meets the chunk's end there), tiny ones, odd ones, and random ones up to two
    chunks."""
    sizes = [1, 3, 7, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK + 5, 4 * CHUNK + 3]
    sizes += [rng.randint(1, 2 * CHUNK) for _ in range(2)] + [rng.randint(1, 64) for _ in range(3)]
    rng.shuffle(sizes)
    return sizes


def unaligned_view(numel: int, dtype, device, gen: torch.Generator,
                   scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous view at an odd element offset (not vector aligned) and its base; the base's
    first and last elements lie outside the view, so stray writes show up there."""
    base = random_tensor(numel + 2, dtype, device, gen, scale)
    return base.narrow(0, 1, numel), base


# ---- inf / NaN injection ----------------------------------------------------------------------

NON_FINITE = (math.inf, -math.inf, math.nan)


def inject_non_finite(t: torch.Tensor, where: str, value: float, gen: torch.Generator) -> int:
    """Writes ``value`` at the first, last or a random flat position of ``t``; returns it."""
    n = t.numel()
    assert n > 0
    pos = {"first": 0, "last": n - 1}.get(where)
    if pos is None:
        assert where == "random", where
        pos = int(torch.randint(0, n, (1,), generator=gen))
    t.view(-1)[pos] = value
    return pos


# ---- poisoning and bitwise comparison ----------------------------------------------------------

@pytest.fixture
def poisoned_empty():
    """torch.empty fills new tensors with NaN (ints with their max) while this is on: an output
    element a kernel forgets to write shows up as NaN, which a test's checks then reject. Use it
    with ``pytestmark = pytest.mark.usefixtures("poisoned_empty")``."""
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
    torch.utils.deterministic.fill_uninitialized_memory = prev[2]


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def torch_grad_scaler(device: str, grad_dtype: torch.dtype, **kwargs) -> torch.amp.GradScaler:
    """torch.amp.GradScaler, skipping the test where torch's own inf check cannot read grads of
    `grad_dtype` on `device` (torch 2.11's CUDA kernel has no bf16): the peer, not mixprec, is missing."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(1, dtype=grad_dtype, device=device)], torch.zeros(1, device=device),
            torch.ones(1, device=device))
    except (NotImplementedError, RuntimeError) as e:
        pytest.skip(f"torch's GradScaler cannot check {grad_dtype} grads on {device}: {e}")
    return torch.amp.GradScaler(device, **kwargs)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` on the CPU, as integers of the same width."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_VIEW[t.element_size()])


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fills ``t`` with a value no correct kernel writes there (NaN for floats) and returns it."""
    if t.is_floating_point():
        return t.fill_(math.nan)
    return t.fill_(torch.iinfo(t.dtype).max if t.dtype != torch.bool else True)


def poisoned_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return poison_(torch.empty_like(t, dtype=dtype or t.dtype))


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "", nan_equal: bool = False) -> None:
    """Bit-for-bit equality (so -0.0 != 0.0). With ``nan_equal`` any NaN matches any NaN: NaN
    payloads are not specified by IEEE arithmetic and differ between CPUs and GPUs."""
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = bits(actual), bits(expected)
    if torch.equal(a, e):
        return
    same = a == e
    if nan_equal and actual.is_floating_point():
        same |= actual.detach().cpu().isnan() & expected.detach().cpu().isnan()
    if not bool(same.all()):
        bad = (~same).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{msg}: {bad.shape[0]} of {actual.numel()} elements differ; first at {first}: "
            f"{actual.detach().cpu()[first].item()!r} != {expected.detach().cpu()[first].item()!r}"
        )


def snapshot(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Clones of every tensor (None kept), to prove later that nothing was modified."""
    return [None if t is None else t.detach().clone() for t in tensors]


def assert_unchanged(before: Sequence[torch.Tensor | None], after: Sequence[torch.Tensor | None],
                     what: str = "") -> None:
    """Every tensor bit-identical to its snapshot (NaN payloads included)."""
    assert len(before) == len(after)
    for i, (b, a) in enumerate(zip(before, after)):
        if b is None:
            assert a is None
            continue
        assert_bitwise_equal(a, b, f"{what}[{i}] was modified")


# ---- float64 error metrics ----------------------------------------------------------------------


def rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """||actual - reference|| / ||reference|| in float64 (docs/architecture.md's metric); 0 for 0 vs 0."""
    a = actual.detach().to("cpu", torch.float64).flatten()
    r = reference.detach().to("cpu", torch.float64).flatten()
    num = torch.linalg.vector_norm(a - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def assert_rel_err(actual: torch.Tensor, reference: torch.Tensor, tol: float, msg: str = "") -> None:
    err = rel_err(actual, reference)
    assert err < tol, f"{msg}: relative error {err:.3e} >= {tol:.1e}"  # NaN fails here too


def peer_bound(dtype: torch.dtype, peer: torch.Tensor, reference: torch.Tensor, floor: float = 1e-5) -> float:
    """docs/architecture.md's bound for an output: twice the error plain PyTorch makes in the same
    precision (``peer``), and never tighter than the fp32 bound ``floor``. In fp32 the floor is the
    bound unless torch's own error passes half of it: an ill-conditioned result (layer norm's input
    gradient over 3 columns cancels to a few ulps of its terms) is held to torch's error, doubled."""
    peer_err = rel_err(peer, reference)
    if dtype == torch.float32:
        return max(2.0 * peer_err, floor) if math.isfinite(peer_err) else floor
    if not math.isfinite(peer_err):
        # Plain PyTorch overflowed in this precision (e.g. grad*grad past fp16's 65504), so it
        # sets no bound; mixprec computes in fp32 and must stay within a few ulps of the dtype.
        return max(4.0 * torch.finfo(dtype).eps, floor)
    return max(2.0 * peer_err, floor)


# ---- errors -------------------------------------------------------------------------------------


def raises_named(exc_types, op: str, arg: str, index: int | None = None):
    """pytest.raises for an error whose message names ``mixprec::op``, the argument and, when
    given, the list index, as ``mixprec::op: arg[index]``."""
    name = re.escape(f"mixprec::{op}: {arg}") + (re.escape(f"[{index}]") if index is not None else r"(?!\[)")
    return pytest.raises(exc_types, match=name)


def assert_usage_error(parse_args: Callable[[list[str]], object], argv: list[str], message: str, capsys) -> None:
    """A benchmark's ``parse_args(argv)`` exits as argparse does for bad usage (code 2), with
    ``message`` in what it printed to stderr."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def check_rejected(fn: Callable[[], object], tensors: Sequence[torch.Tensor | None], exc_types, op: str, arg: str,
                   index: int | None = None, device=None) -> None:
    """``fn()`` raises an error naming op, argument and index, and leaves ``tensors`` untouched."""
    before = snapshot(tensors)
    with raises_named(exc_types, op, arg, index):
        fn()
        if device is not None:
            sync(device)
    if device is not None:
        sync(device)
    assert_unchanged(before, tensors, f"{op} (rejecting {arg}): argument tensor")
