# Smoke tests of benchmarks/e2e_gpt2.py (the end-to-end GPT-2 benchmark): the script runs on the
# tiny model, writes JSON with finite, comparable losses; the profiler attribution and the
# command-line checks behave. On a GPU the CUDA path (events, memory stats, profiler) runs too.
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_usage_error

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, os.path.abspath(BENCH))

import e2e_gpt2  # noqa: E402
from e2e_phases import PHASES, attribute, device_gaps, kernel_kind  # noqa: E402


def run_script(tmp_path, *args: str) -> dict:
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, os.path.join(BENCH, "e2e_gpt2.py"), "--tiny", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    with open(out) as f:
        return json.load(f)


def check_rows(data: dict, variants: list[str], steps: int) -> dict:
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == variants
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["status"])
        assert r["steps"] == steps
        assert math.isfinite(r["loss"]) and math.isfinite(r["train_loss"]), name
        assert all(math.isfinite(v) for _, v in r["train_losses"]), name
        assert r["ms"] > 0 and r["tok_s"] > 0 and set(r["phases_ms"]) == set(PHASES)
        assert r["skipped_steps"] == 0, name
    # Same start (weights built from one seed) and losses that agree across precisions.
    assert len({r["init_checksum"] for r in rows.values()}) == 1
    losses = [r["loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 0.01 * min(losses), losses
    return rows


def test_cpu_tiny_bf16_variants(tmp_path):
    variants = ["torch-bf16", "mixprec-o2-bf16", "mixprec-o2-bf16-xent", "mixprec-adam-bf16"]
    data = run_script(tmp_path, "--device", "cpu", "--steps", "2", "--warmup", "1", "--variants", ",".join(variants))
    rows = check_rows(data, variants, steps=3)
    assert rows["mixprec-o2-bf16"]["peer"] == "torch-bf16"
    assert "vs_peer" in rows["mixprec-o2-bf16"] and "loss_vs_peer_pct" in rows["mixprec-o2-bf16"]
    assert data["environment"]["device"] == "cpu"


def test_loss_falls_on_the_synthetic_language(tmp_path):
    # The data must be learnable, or "loss after N steps" would compare noise.
    data = run_script(tmp_path, "--device", "cpu", "--long-run", "30", "--warmup", "1", "--variants", "fp32",
                      "--lr", "1e-3")
    r = check_rows(data, ["fp32"], steps=30)["fp32"]
    first = r["train_losses"][0][1]
    assert first > math.log(512) * 0.9  # near uniform at the start
    assert r["loss"] < first - 1.0, r["train_losses"]


def test_a_failing_variant_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def broken(model, device, hyper):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    bad = dataclasses.replace(e2e_gpt2.VARIANTS["mixprec-adam-bf16"], make=broken)
    monkeypatch.setitem(e2e_gpt2.VARIANTS, "mixprec-adam-bf16", bad)
    out = tmp_path / "e2e.json"
    e2e_gpt2.main(["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--variants",
                   "mixprec-adam-bf16,torch-bf16", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["mixprec-adam-bf16"]["status"] == "error: OutOfMemoryError: CUDA out of memory (simulated)"
    assert rows["torch-bf16"]["status"] == "ok" and math.isfinite(rows["torch-bf16"]["loss"])
    assert "1 variant(s) did not complete" in capsys.readouterr().out


def test_attribution_by_phase_range():
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, start, end, device, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    events = [
        ev("e2e::forward", 0, 100, cpu), ev("e2e::backward", 100, 300, cpu),
        ev("e2e::loss_scale", 300, 310, cpu), ev("e2e::optimizer", 310, 400, cpu),
        ev("e2e::forward", 0, 100, cuda, annotation=True),  # the GPU copy of a range: not work
        ev("ampere_sgemm_128x64_nn", 10, 30, cuda), ev("flash_fwd_kernel", 40, 50, cuda),
        ev("sm90_xmma_gemm_bf16", 120, 200, cuda),
        ev("void mixprec::kernels::multi_tensor_kernel<1, mixprec::kernels::UnscaleOp>", 302, 306, cuda),
        ev("void mixprec::kernels::multi_tensor_kernel<5, mixprec::kernels::AdamOp<float>>", 320, 380, cuda),
        ev("aten::addmm", 10, 30, cpu),  # host op: not device time
        ev("Memcpy DtoH", 500, 502, cuda),  # outside every range
    ]
    s = attribute(events, n_steps=2)
    assert s["phase_busy_ms"] == pytest.approx({"forward": 0.015, "backward": 0.04, "loss_scale": 0.002,
                                                "optimizer": 0.03, "unattributed": 0.001})
    assert s["busy_ms"] == pytest.approx(0.088)
    assert s["kinds_ms"] == pytest.approx({"matmul": 0.05, "attention": 0.005, "loss scaling": 0.002,
                                           "optimizer": 0.03, "memcpy/memset": 0.001})
    assert [n for n, _ in s["top_kernels_ms"][:2]] == ["sm90_xmma_gemm_bf16", events[9].name]
    assert s["top_kernels_ms"][0][1] == pytest.approx(0.04)


def test_device_gaps_merge_overlaps_and_rank_the_waits():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=False)

    events = [
        ev("gemm_a", 0, 100), ev("side_stream", 50, 120),  # overlapping: one busy stretch 0-120
        ev("aten::addmm", 100, 400, cpu),  # host time is not device time
        ev("layer_norm", 150, 200),  # a 30 us gap after side_stream
        ev("adam", 210, 300),  # 10 us
        ev("embedding", 400, 500),  # 100 us
    ]
    g = device_gaps(events, n_steps=2)
    assert g["span_ms"] == pytest.approx(0.25)  # 500 us over two steps
    assert g["busy_ms"] == pytest.approx((120 + 50 + 90 + 100) / 2e3)
    assert g["idle_ms"] == pytest.approx(140 / 2e3)
    assert g["gaps_over_20us"] == 1.0  # two of them in two steps
    assert g["top_gaps"] == [(100.0, "adam", "embedding"), (30.0, "side_stream", "layer_norm"),
                             (10.0, "layer_norm", "adam")]
    assert device_gaps([ev("aten::mm", 0, 5, cpu)], n_steps=1)["idle_ms"] == 0.0


@pytest.mark.parametrize("name, kind", [
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("void at::native::amp_update_scale_cuda_kernel(float*, int*, float const*)", "loss scaling"),
    ("void at::native::vectorized_layer_norm_kernel<c10::Half, float>", "layernorm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::Half, float, 32u>",
     "layernorm"),
    ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", "elementwise/other"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
])
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


@pytest.mark.parametrize("argv, message", [
    (["--variants", "fp32,nope"], "unknown variant"),
    (["--sizes", "huge"], "unknown size"),
    (["--tiny", "--sizes", "large"], "--tiny runs the tiny model only"),
    (["--variants", "fp32,fp32"], "listed twice"),
    (["--long-run", "3", "--warmup", "5"], "must exceed --warmup"),
    (["--steps", "0"], "--steps"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    assert_usage_error(e2e_gpt2.parse_args, argv, message, capsys)


def test_graph_variants_are_cuda_only():
    cpu = e2e_gpt2.parse_args(["--device", "cpu", "--tiny"])
    graphs = [n for n, v in e2e_gpt2.VARIANTS.items() if v.cuda_only]
    assert graphs and all(n.endswith("-graph") for n in graphs)
    assert not set(graphs) & set(cpu.variant_list)
    assert set(cpu.variant_list) | set(graphs) == set(e2e_gpt2.VARIANTS)


def test_repeats_run_interleaved_and_average_the_loss(tmp_path):
    variants = ["torch-bf16", "mixprec-o2-bf16"]
    data = run_script(tmp_path, "--device", "cpu", "--steps", "1", "--warmup", "1", "--repeats", "2",
                      "--variants", ",".join(variants))
    assert [(r["variant"], r["repeat"]) for r in data["runs"]] == [
        ("torch-bf16", 0), ("mixprec-o2-bf16", 0), ("torch-bf16", 1), ("mixprec-o2-bf16", 1)]
    rows = check_rows(data, variants, steps=2)
    for name, r in rows.items():
        runs = [x["loss"] for x in data["runs"] if x["variant"] == name]
        assert r["repeats"] == 2 and r["loss_runs"] == runs
        assert r["loss"] == pytest.approx(sum(runs) / 2)
    assert data["config"]["repeats"] == 2


def _run_row(variant: str, ms: float, min_ms: float, loss: float, peer=None) -> dict:
    return {"size": "large", "variant": variant, "peer": peer, "status": "ok", "ms": ms, "min_ms": min_ms,
            "loss": loss, "skipped_steps": 0, "steps": 25, "repeat": 0}


def test_summary_times_the_median_steady_run_and_judges_speed_only_when_both_are_steady():
    o2 = "mixprec-o2-fp16"
    runs = [
        _run_row("torch-fp16", 66.0, 65.9, 5.20), _run_row(o2, 53.0, 52.5, 5.15, peer="torch-fp16"),
        _run_row("torch-fp16", 90.0, 66.0, 5.14), _run_row(o2, 80.0, 52.4, 5.15, peer="torch-fp16"),  # stalled
        _run_row("torch-fp16", 66.5, 66.2, 5.22), _run_row(o2, 52.6, 52.3, 5.16, peer="torch-fp16"),
    ]
    rows = {r["variant"]: r for r in e2e_gpt2.summarize(runs)}
    # Timing: the median of the steady runs (an even count takes the faster middle one), never a stalled one.
    assert rows["torch-fp16"]["ms"] == 66.0 and rows[o2]["ms"] == 52.6
    assert rows[o2]["steady_repeats"] == 2 and rows[o2]["repeats"] == 3 and rows[o2]["min_ms"] == 52.3
    # Loss: the mean of every run, stalled ones included (a stall changes the time, not the result).
    assert rows["torch-fp16"]["loss"] == pytest.approx((5.20 + 5.14 + 5.22) / 3)
    summary = list(rows.values())
    e2e_gpt2.compare(summary)
    assert rows[o2]["vs_peer"] == pytest.approx(66.0 / 52.6)
    verdicts = e2e_gpt2.bars(summary, long_run=False)
    assert any(v.startswith("PASS large mixprec-o2-fp16: 1.255x") for v in verdicts), verdicts
    assert any("means of 3 runs each" in v and v.startswith("PASS") for v in verdicts), verdicts

    # No steady run of the peer: the speed bar is reported, not judged.
    unsteady = [dict(r, ms=r["ms"] * 1.2) if r["variant"] == "torch-fp16" else r for r in runs]
    summary = e2e_gpt2.summarize(unsteady)
    e2e_gpt2.compare(summary)
    speed = [v for v in e2e_gpt2.bars(summary, long_run=False) if "tokens/s" in v]
    assert speed and all(v.startswith("UNSTEADY") for v in speed), speed


@pytest.mark.cuda
def test_cuda_tiny_every_variant_with_profile(tmp_path):
    # The CUDA path end to end in seconds: events, peak memory, the profiler pass, every variant.
    variants = list(e2e_gpt2.VARIANTS)
    data = run_script(tmp_path, "--device", "cuda", "--steps", "3", "--warmup", "2", "--profile",
                      "--profile-steps", "2")
    rows = check_rows(data, variants, steps=5)
    for name, r in rows.items():
        assert r["peak_GiB"] > 0 and r["peak_GiB"] >= r["setup_GiB"], name
        p = r["profile"]
        assert p["busy_ms"] > 0 and p["phases"]["forward"]["busy_ms"] > 0, name
        if name.endswith("-graph"):  # a replay is one launch: its phases are all marked after it
            eager = rows[name[:-len("-graph")]]
            assert r["loss"] == pytest.approx(eager["loss"], rel=1e-3), name
            assert r["skipped_steps"] == eager["skipped_steps"], name
            continue
        assert p["phases"]["optimizer"]["busy_ms"] > 0, name
        assert p["unattributed_busy_ms"] < 0.1 * p["busy_ms"], (name, p)
        u = p["unsynced"]
        assert 0 < u["busy_ms"] <= u["span_ms"] and u["idle_ms"] == pytest.approx(u["span_ms"] - u["busy_ms"]), name
        assert u["step_ms"] > 0 and len(u["top_gaps"]) > 0, name


def test_unsteady_runs_are_retried_and_every_attempt_kept(tmp_path, monkeypatch):
    # The first attempt of each variant comes back unsteady (a host stall), the second steady.
    attempts: dict[str, int] = {}

    def fake_run(name, size, *args, **kwargs):
        attempts[name] = attempts.get(name, 0) + 1
        ms = 60.0 if attempts[name] == 1 else 50.0
        return {"size": size, "variant": name, "peer": e2e_gpt2.VARIANTS[name].peer, "status": "ok", "ms": ms,
                "min_ms": 50.0, "tok_s": 1.0, "loss": 5.0 + attempts[name], "skipped_steps": 0, "steps": 3}

    monkeypatch.setattr(e2e_gpt2, "run_variant", fake_run)
    out = tmp_path / "e2e.json"
    e2e_gpt2.main(["--device", "cpu", "--tiny", "--variants", "torch-bf16,mixprec-o2-bf16", "--retry-unsteady", "2",
                   "--out", str(out)])
    data = json.loads(out.read_text())
    assert attempts == {"torch-bf16": 2, "mixprec-o2-bf16": 2}  # stopped at the first steady attempt
    assert [(r["variant"], r["attempt"]) for r in data["runs"]] == [
        ("torch-bf16", 0), ("torch-bf16", 1), ("mixprec-o2-bf16", 0), ("mixprec-o2-bf16", 1)]
    rows = {r["variant"]: r for r in data["results"]}
    assert rows["mixprec-o2-bf16"]["ms"] == 50.0 and rows["mixprec-o2-bf16"]["steady"]
    assert rows["mixprec-o2-bf16"]["loss"] == pytest.approx(6.5)  # both attempts' losses count
    assert data["config"]["retry_unsteady"] == 2
