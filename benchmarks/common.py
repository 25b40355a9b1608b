"""Shared benchmark utilities: GPT-2 parameter shapes, GPU/CPU timers, same-run copy bandwidth,
result tables and JSON records. Every script under benchmarks/ measures the same way (DESIGN.md)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

Shape = tuple[int, ...]

# ---- parameter shapes -------------------------------------------------------------------------


def gpt_shapes(n_layer: int, n_embd: int, vocab: int = 50304, n_ctx: int = 1024) -> list[Shape]:
    """Parameter shapes of a GPT-2-style model, in nn.Module order (weights (out, in) as in nn.Linear).

    Token and position embeddings; per block LayerNorm, fused qkv, attention proj, LayerNorm, MLP fc
    (4x) and fc2, each Linear with a bias; a final LayerNorm. The LM head is tied to the embedding.
    """
    shapes: list[Shape] = [(vocab, n_embd), (n_ctx, n_embd)]
    for _ in range(n_layer):
        shapes += [(n_embd,), (n_embd,)]                          # ln_1 weight, bias
        shapes += [(3 * n_embd, n_embd), (3 * n_embd,)]           # attn.c_attn (qkv)
        shapes += [(n_embd, n_embd), (n_embd,)]                   # attn.c_proj
        shapes += [(n_embd,), (n_embd,)]                          # ln_2 weight, bias
        shapes += [(4 * n_embd, n_embd), (4 * n_embd,)]           # mlp.c_fc
        shapes += [(n_embd, 4 * n_embd), (n_embd,)]               # mlp.c_proj (fc2)
    shapes += [(n_embd,), (n_embd,)]                              # ln_f weight, bias
    return shapes


def gpt2_medium_shapes() -> list[Shape]:
    """The GPT-2-medium set of DESIGN.md: 354.9 M parameters in 292 tensors (24 layers, width 1024)."""
    return gpt_shapes(24, 1024)


# Named sets a benchmark can pick with --shapes. The small ones exist for CPUs and smoke runs;
# every set but "tiny" is far larger than any GPU L2 or CPU L3, so each run streams from memory.
SHAPE_SETS: dict[str, Callable[[], list[Shape]]] = {
    "gpt2-medium": gpt2_medium_shapes,                    # 354.9 M params, 292 tensors
    "gpt2-small": lambda: gpt_shapes(12, 768),            # 124.5 M params, 148 tensors
    "gpt2-mini": lambda: gpt_shapes(6, 512, vocab=16384),  # 27.8 M params, 76 tensors
    "tiny": lambda: gpt_shapes(2, 128, vocab=4096, n_ctx=256),  # 0.95 M params: smoke runs only
}


def numel_of(shapes: Iterable[Shape]) -> int:
    total = 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        total += n
    return total


def self_check() -> None:
    """Asserts the GPT-2-medium set matches DESIGN.md's count (292 tensors, 354,871,296 params)."""
    shapes = gpt2_medium_shapes()
    assert len(shapes) == 292, len(shapes)
    assert numel_of(shapes) == 354_871_296, numel_of(shapes)
    assert shapes[0] == (50304, 1024) and shapes[1] == (1024, 1024)
    assert shapes[2:14] == [(1024,), (1024,), (3072, 1024), (3072,), (1024, 1024), (1024,),
                            (1024,), (1024,), (4096, 1024), (4096,), (1024, 4096), (1024,)]
    assert shapes[-2:] == [(1024,), (1024,)]
    assert numel_of(SHAPE_SETS["gpt2-small"]()) == 124_475_904  # GPT-2 small with padded vocab


# ---- timing -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Seconds per call over `runs` timed calls."""

    median: float
    min: float
    max: float
    runs: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Timing":
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))


def _caller(fn: Callable, arg_sets: Optional[Sequence[tuple]]) -> Callable[[int], object]:
    # Rotating among several argument sets defeats caches when one set could stay resident in L2
    # (or L3) between runs, and lets a benchmark alternate values (e.g. scale, then 1/scale) so
    # repeated in-place passes leave the data where it started.
    if not arg_sets:
        return lambda i: fn()
    return lambda i: fn(*arg_sets[i % len(arg_sets)])


#: The spin before a host_ahead sample: about 1 ms at the H200's 1.98 GHz, far more than the host
#: needs to queue a few launches.
HOST_AHEAD_CYCLES = 2_000_000


def time_many(
    fns: dict[str, Callable],
    device: torch.device,
    *,
    runs: int = 15,
    warmup: int = 3,
    arg_sets: Optional[dict[str, Sequence[tuple]]] = None,
    inner: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    host_ahead: bool = False,
) -> dict[str, Timing]:
    """Times each function `runs` times, interleaved round-robin, after `warmup` untimed calls each.

    Interleaving puts clock and thermal drift on every contender alike, so ratios measured in one
    run are fair. On CUDA each sample is the time between two events around the call(s) on the
    current stream (the device time, launch gaps included); on the CPU it is `clock`: wall time
    (time.perf_counter) unless told otherwise.
    `inner` > 1 times that many back-to-back calls per sample and reports the time per call (for
    ops too short to time one by one). `arg_sets[name]` rotates the arguments, see _caller.
    `host_ahead` (CUDA): a spin kernel runs before each sample's start event, so the host has queued
    the sample's launches before the device reaches them, and the sample is the device's time alone
    (for kernels shorter than their launch, whose event time is otherwise the host's).
    """
    callers = {name: _caller(fn, (arg_sets or {}).get(name)) for name, fn in fns.items()}
    counters = dict.fromkeys(fns, 0)

    def call(name: str) -> None:
        for _ in range(inner):
            callers[name](counters[name])
            counters[name] += 1

    for name in fns:
        for _ in range(warmup):
            call(name)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(runs)] for n in fns}
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(runs):
        for name in fns:
            if cuda:
                start, end = events[name][r]
                if host_ahead:
                    torch.cuda._sleep(HOST_AHEAD_CYCLES)
                start.record()
                call(name)
                end.record()
            else:
                t0 = clock()
                call(name)
                samples[name].append((clock() - t0) / inner)
    if cuda:
        torch.cuda.synchronize(device)
        for name in fns:
            samples[name] = [s.elapsed_time(e) / 1e3 / inner for s, e in events[name]]
    return {name: Timing.of(samples[name]) for name in fns}


def time_fn(fn: Callable, device: torch.device, **kwargs) -> Timing:
    """Times one function; see time_many for the method and arguments (arg_sets: a list here)."""
    if "arg_sets" in kwargs:
        kwargs["arg_sets"] = {"fn": kwargs["arg_sets"]}
    return time_many({"fn": fn}, device, **kwargs)["fn"]


# ---- bandwidth --------------------------------------------------------------------------------


@dataclasses.dataclass
class CopyBandwidth:
    """A device-to-device copy measured in this run: the ceiling a streaming op is compared to."""

    bytes_per_s: float
    buffer_bytes: int
    timing: Timing


def measure_copy_bandwidth(device: torch.device, nbytes: Optional[int] = None, runs: int = 15,
                           warmup: int = 3) -> CopyBandwidth:
    """dst.copy_(src) over one large contiguous buffer; counts bytes read + bytes written.

    Default size: 1 GiB on CUDA (20x any L2), 256 MiB on the CPU (8x a 32 MiB L3, still quick).
    """
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device, runs=runs, warmup=warmup)
    moved = 2 * src.numel() * src.element_size()
    return CopyBandwidth(moved / timing.median, moved, timing)


def bandwidth_units(device: torch.device) -> tuple[str, float]:
    """TB/s on GPUs, GB/s on CPUs: the unit that keeps figures readable."""
    return ("TB/s", 1e12) if device.type == "cuda" else ("GB/s", 1e9)


def achieved(nbytes: int, seconds: float, copy: CopyBandwidth) -> tuple[float, float]:
    """(bytes/s, share of the measured copy bandwidth in %) for an op that must move `nbytes`."""
    bw = nbytes / seconds
    return bw, 100.0 * bw / copy.bytes_per_s


# ---- environment and output -------------------------------------------------------------------


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    """What a result needs to be reproducible: date, device, versions, threads, command line."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) if sys.argv and sys.argv[0] else "",
        "device": device.type,
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        # Other processes competing for the cores make CPU figures noisy; record how busy it was.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    try:
        import mixprec

        env["mixprec"] = mixprec.__version__
    except Exception as e:  # a broken build must still let the peers' figures be recorded
        env["mixprec"] = f"unavailable: {e}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
        env["l2_cache_mib"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)
    return env


def busy_warning(env: dict) -> Optional[str]:
    """A warning line when the machine was oversubscribed at the start (CPU timings then unreliable)."""
    load, cores = env.get("load_avg_1m"), env.get("cpu_count") or 1
    if env["device"] == "cpu" and load is not None and load > 0.75 * cores:
        return (f"# WARNING: load average {load} on {cores} cores: other processes compete for the CPU, "
                "so timings are noisy (compare the min columns too)")
    return None


def device_label(env: dict) -> str:
    if env["device"] == "cuda":
        return f"{env['gpu']} (CUDA {env['cuda']})"
    n = env["cpu_threads"]
    return f"CPU {env['cpu']} ({env['cpu_count']} cores), {n} thread{'s' if n != 1 else ''}"


def format_table(rows: Sequence[dict], columns: Sequence[str], headers: Optional[Sequence[str]] = None) -> str:
    """A plain fixed-width table (also valid Markdown) of rows' `columns`; floats get 3 significant
    decimals unless already strings; missing values print as '-'."""
    headers = list(headers or columns)

    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]
    numeric = [all(_is_number(b[i]) for b in body) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(headers), sep] + [line(b) for b in body])


def _is_number(s: str) -> bool:
    try:
        float(s.rstrip("x%"))
        return True
    except ValueError:
        return s == "-"


def write_json(path: str, env: dict, results: Sequence[dict], **extra) -> None:
    """Writes {"environment": env, "results": [...], **extra} to `path` (parent folders created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, **extra, "results": list(results)}, f, indent=2, default=str)
        f.write("\n")


# ---- command line -----------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser, default_runs: int = 15) -> None:
    """--device, --runs, --warmup, --shapes, --quick, --out: the same flags on every benchmark."""
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where to run (default: cuda if available, else cpu)")
    parser.add_argument("--runs", type=int, default=None,
                        help=f"timed runs per variant, median reported (default {default_runs}; --quick: 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3; --quick: 1)")
    parser.add_argument("--shapes", choices=sorted(SHAPE_SETS), default=None,
                        help="parameter set (default: gpt2-medium on CUDA, a smaller set on the CPU)")
    parser.add_argument("--quick", action="store_true", help="fast smoke run: few runs, small shapes on the CPU")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch and mixprec (default: torch's)")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this path")
    parser.set_defaults(_default_runs=default_runs)


def resolve_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The device to run on; a CUDA request without a usable GPU exits with a clear message (code 2).
    Also applies --threads (both libraries use ATen's thread pool)."""
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) sees no usable GPU")
        parser.error(f"--device cuda requested but {why} (torch {torch.__version__}); use --device cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_runs(args: argparse.Namespace) -> tuple[int, int]:
    runs = args.runs if args.runs is not None else (5 if args.quick else args._default_runs)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if runs < 1 or warmup < 0:
        raise SystemExit("--runs must be >= 1 and --warmup >= 0")
    return runs, warmup


if __name__ == "__main__":
    self_check()
    for name, make in SHAPE_SETS.items():
        s = make()
        print(f"{name:12s} {len(s):4d} tensors {numel_of(s) / 1e6:8.1f} M params")
