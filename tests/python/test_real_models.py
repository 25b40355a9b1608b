# Real models through mixprec.amp (issue 22), tiny configs on the CPU: transformers GPT-2 and a
# Llama-style decoder, timm ResNet-50 (channels_last) and ViT, built by benchmarks/real_models_zoo.py.
# Each trains beside an fp32 reference, one O2 step is checked against float64 AdamW from the fp32
# masters, and a checkpoint resumes bitwise. Skipped where transformers or timm is not installed.
from __future__ import annotations

import copy
import io
import math
import os
import sys

import pytest
import torch

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
sys.path.insert(0, BENCH)

import real_models_zoo as zoo  # noqa: E402
# One ATen thread (autouse): on shared cores two spinning OpenMP threads made a tiny ResNet step
# take seconds instead of 15 ms.
from amp_support import one_cpu_thread  # noqa: E402

from mixprec import amp  # noqa: E402
from mixprec.optimizers import FusedAdam  # noqa: E402

FAMILIES = list(zoo.MODELS)
SEQ, BATCH = 16, 8
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CPU = torch.device("cpu")


def spec_of(name: str) -> zoo.ModelSpec:
    spec = zoo.MODELS[name]
    zoo.import_torchvision()  # beside a CPU torch, PyPI's torchvision needs this to import (see there)
    pytest.importorskip(spec.library, reason=f"{spec.library} is not installed ({zoo.INSTALL_HINT})")
    return spec


def fresh(spec: zoo.ModelSpec, seed: int = 0) -> torch.nn.Module:
    return zoo.build(spec, True, SEQ, seed, CPU)


def batches(spec: zoo.ModelSpec, count: int, seed: int = 1) -> zoo.Batches:
    return zoo.Batches(spec, True, BATCH, SEQ, count, seed, CPU)


def train(spec, model, optimizer, data, steps: range, use_amp: bool) -> list[float]:
    losses = []
    for i in steps:
        optimizer.zero_grad(set_to_none=True)
        loss = zoo.loss_of(spec, model, *data[i])
        if use_amp:
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        else:
            loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def held_out_loss(spec, model, batch) -> float:
    model.eval()
    try:
        return float(zoo.loss_of(spec, model, *batch))
    finally:
        model.train()


def amp_model(spec, level: str, dtype: torch.dtype, seed: int = 0, hyper: dict = HYPER, **kwargs):
    model = fresh(spec, seed)
    optimizer = FusedAdam(model.parameters(), adam_w_mode=True, **hyper)
    return amp.initialize(model, optimizer, opt_level=level, dtype=dtype, verbosity=0, **kwargs)


# ---- training beside fp32 -----------------------------------------------------------------------

STEPS = 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trains_like_fp32(family, level, dtype):
    """O1/O2 and fp32 from the same weights on the same batches: the held-out loss falls by as
    much. bf16 keeps 8 mantissa bits (fp16 10), so each step's update differs from fp32's by ~0.4%
    of its size and the runs drift apart a little; after 8 steps the gap stays under a quarter of
    the fp32 run's fall (measured: under 3%), while a broken cast (a parameter that stops training,
    a norm in the wrong precision, a lost gradient) leaves the loss near where it started. fp16's
    dynamic scale starts at 2**10, where no step of these models overflows: a skipped step would
    leave the runs a step apart. The image models train at lr 1e-3: at 3e-3 their first steps on
    batches of 8 are chaotic enough that bf16's rounding alone moved the loss after 8 steps by a
    quarter of the fall (O1 as much as O2, so autocast too); at 1e-3 by 2%."""
    spec = spec_of(family)
    hyper = dict(HYPER, lr=1e-3 if spec.kind == "image" else HYPER["lr"])
    data = batches(spec, STEPS + 1)
    held = data[STEPS]  # of the same language (or class patterns), never trained on
    ref = fresh(spec)
    start = held_out_loss(spec, ref, held)
    ref_losses = train(spec, ref, FusedAdam(ref.parameters(), adam_w_mode=True, **hyper), data, range(STEPS), False)
    ref_end = held_out_loss(spec, ref, held)
    fall = start - ref_end
    assert fall > 0.05 * start, (start, ref_end, ref_losses)  # the task is learnable in these steps

    model, optimizer = amp_model(spec, level, dtype, hyper=hyper, max_loss_scale=2.0**10)
    losses = train(spec, model, optimizer, data, range(STEPS), True)
    end = held_out_loss(spec, model, held)
    assert all(math.isfinite(v) for v in losses), losses
    assert optimizer.param_groups[0]["step"] == STEPS  # none skipped
    assert abs(losses[0] - ref_losses[0]) < 0.02 * ref_losses[0]  # the same first forward, in low precision
    assert abs(end - ref_end) < 0.25 * fall, (level, start, ref_end, end, ref_losses, losses)


# ---- one O2 step against float64 ----------------------------------------------------------------


def float64_grads(spec, model: torch.nn.Module, batch, autocast=None) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    if autocast is None:
        m = m.double()
        x, y = batch
        batch = (x.double() if x.is_floating_point() else x, y)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        zoo.loss_of(spec, m, *batch).backward()
    return {n: p.grad.double() for n, p in m.named_parameters()}


def rel(a: dict, b: dict) -> float:
    num = math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in b))
    return num / math.sqrt(sum(float(v.pow(2).sum()) for v in b.values()))


def adamw_float64(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """One AdamW step from zero moments, in float64."""
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    p, g = p.double(), g.double()
    m_hat = (1 - b1) * g / (1 - b1)
    v_hat = (1 - b2) * g * g / (1 - b2)
    return p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)


def tied(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names that reach one Parameter (GPT-2's LM head and token embedding)."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return sorted(sorted(names) for names in by_id.values() if len(names) > 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_o2_step_matches_fp32_master_reference(family, dtype):
    """One O2 step: the gradient as close to float64's as autocast's, each fp32 master where
    float64 AdamW puts the fp32 weight with that gradient, the model copy its rounding, ties kept."""
    spec = spec_of(family)
    batch = batches(spec, 1)[0]
    model = fresh(spec)
    ties = tied(model)
    assert bool(ties) == (family == "gpt2"), ties
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads64 = float64_grads(spec, model, batch)
    autocast_err = rel(float64_grads(spec, model, batch, autocast=dtype), grads64)

    # A dynamic scale of 2**10 (not 2**16, which overflows these fp16 gradients on the first step).
    model, optimizer = amp_model(spec, "O2", dtype, max_loss_scale=2.0**10)
    assert tied(model) == ties  # the cast kept the Parameter objects: one master for a tied pair
    scale = amp.loss_scale() if dtype == torch.float16 else 1.0
    params = dict(model.named_parameters())
    loss = zoo.loss_of(spec, model, *batch)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    # The gradient the step will use (scaled in .grad, fp32 BatchNorm's too, until the fused kernel
    # unscales it).
    grads = {n: p.grad.double() / scale for n, p in params.items()}
    assert all(torch.isfinite(g).all() for g in grads.values())
    # As close to float64 as torch.amp's autocast gets, within 2x (DESIGN.md's rule) and a floor for
    # models whose autocast error is tiny.
    assert rel(grads, grads64) <= 2 * autocast_err + 1e-3, (rel(grads, grads64), autocast_err)
    optimizer.step()

    modules = dict(model.named_modules())
    cast = 0
    for n, p in params.items():
        expected = adamw_float64(originals[n], grads[n])
        master = optimizer.state[p]["master_param"] if p.dtype == dtype else p.detach()
        # fp32 element-wise math against float64: errors of a few fp32 ulps of the weight.
        torch.testing.assert_close(master.double(), expected, rtol=1e-6, atol=1e-7, msg=n)
        if p.dtype == dtype:
            cast += 1
            assert torch.equal(p.detach(), master.to(dtype)), n  # the model copy is the rounded master
        else:  # only BatchNorm stays fp32 under O2
            assert isinstance(modules[n.rpartition(".")[0]], torch.nn.modules.batchnorm._BatchNorm), (n, p.dtype)
    assert cast > 0


# ---- checkpoint round trip ----------------------------------------------------------------------


def make_amp(spec, route: str, dtype: torch.dtype, seed: int):
    if route == "fused":
        return amp_model(spec, "O2", dtype, seed=seed, max_loss_scale=2.0**10)
    model = fresh(spec, seed)  # a torch optimizer: Apex's fp32 masters in its param groups
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    return amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0, max_loss_scale=2.0**10)


def save(route: str, model, optimizer) -> dict:
    if route == "fused":  # the three state_dicts of Apex's recipe hold everything here
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    return {"amp_checkpoint": amp.checkpoint_state(model, optimizer)}  # masters in param groups too


def load(state: dict, model, optimizer) -> None:
    if "amp_checkpoint" in state:
        amp.load_checkpoint_state(state["amp_checkpoint"], model, optimizer)
        return
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    amp.load_state_dict(state["amp"])


@pytest.mark.parametrize("route", ["fused", "torch-adamw"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_resumes_bitwise(family, dtype, route):
    """model + optimizer (masters, moments, steps) + amp (loss scale) through torch.save and
    torch.load(weights_only=True): a model built from other weights resumes exactly. FusedAdam
    keeps the masters in its state_dict; a torch optimizer's are in its param groups, which
    amp.checkpoint_state saves (docs/amp.md, "Checkpoints"). The RNG state goes along, as
    training loops save it: GPT-2 and Llama's configs have dropout."""
    spec = spec_of(family)
    data = batches(spec, 5)
    model, optimizer = make_amp(spec, route, dtype, seed=0)
    train(spec, model, optimizer, data, range(3), True)
    buf = io.BytesIO()
    torch.save({**save(route, model, optimizer), "rng": torch.get_rng_state()}, buf)
    expected = train(spec, model, optimizer, data, range(3, 5), True)
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_buffers = {n: b.clone() for n, b in model.named_buffers()}
    del model, optimizer

    model, optimizer = make_amp(spec, route, dtype, seed=7)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    load(state, model, optimizer)
    torch.set_rng_state(state["rng"])
    assert train(spec, model, optimizer, data, range(3, 5), True) == expected
    for n, p in model.named_parameters():
        assert p.dtype == expected_params[n].dtype and torch.equal(p.detach(), expected_params[n]), n
    for n, b in model.named_buffers():
        assert b.dtype == expected_buffers[n].dtype and torch.equal(b, expected_buffers[n]), n


# ---- what the models found in amp.initialize's cast ---------------------------------------------


class FrequencyTable(torch.nn.Module):
    """A module that keeps its frequency buffer fp32 on a cast, as timm's rotary embeddings do
    (their _apply rebuilds the bands in fp32 after model.to(bf16))."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("freq", 1.0 / 10000 ** (torch.arange(8) / 8), persistent=False)
        self.register_buffer("table", torch.randn(8))

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        if self.freq.dtype != torch.float32:
            self.freq = 1.0 / 10000 ** (torch.arange(8, device=self.freq.device) / 8)
        return module

    def forward(self, x):
        angles = torch.arange(x.shape[0], device=x.device)[:, None] * self.freq
        return self.proj(x) * angles.cos().to(x.dtype)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_cast_goes_through_the_modules_apply(level):
    """O2/O3 cast each module as module.to(dtype) would, through its _apply: a module that keeps a
    buffer in fp32 on a cast keeps it (before: its frequencies were rounded to bf16 behind its back)."""
    torch.manual_seed(0)
    model = FrequencyTable()
    freq, table = model.freq.clone(), model.table.clone()
    model.proj.weight.grad = torch.randn(8, 8)
    model = amp.initialize(model, opt_level=level, dtype=torch.bfloat16, verbosity=0)
    assert model.freq.dtype == torch.float32 and torch.equal(model.freq, freq)
    assert model.table.dtype == torch.bfloat16 and torch.equal(model.table, table.bfloat16())
    assert model.proj.weight.dtype == torch.bfloat16 and model.proj.weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(model(torch.randn(4, 8))).all()


def test_cast_keeps_the_parameter_objects_under_torchs_overwrite_flag():
    """module.to(dtype) under torch.__future__'s overwrite flag makes new Parameters; O2's cast goes
    through the same _apply and must not: the optimizer holds the old ones."""
    torch.manual_seed(0)
    model = FrequencyTable()
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        assert torch.__future__.get_overwrite_module_params_on_conversion()  # put back as it was
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert optimizer.param_groups[0]["params"] == params


def test_llama_rotary_frequencies_stay_fp32_under_o2():
    """transformers' rotary embedding computes cos/sin in fp32 from inv_freq and returns them in the
    input's dtype; O2 used to round inv_freq to bf16, turning the angles at position 1000 by up to a
    radian. Now cos/sin match the fp32 model's to bf16's rounding of the result, as under torch.amp."""
    spec = spec_of("llama")
    torch.manual_seed(0)
    ref = zoo.build(spec, True, 2048, 0, CPU)
    model = amp.initialize(copy.deepcopy(ref), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    rotary, ref_rotary = model.model.rotary_emb, ref.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, ref_rotary.inv_freq)
    positions = torch.randint(0, 2048, (1, 256))
    x = torch.randn(1, 256, 64)
    cos, sin = rotary(x.bfloat16(), positions)
    ref_cos, ref_sin = ref_rotary(x, positions)
    assert cos.dtype == torch.bfloat16
    for got, want in ((cos, ref_cos), (sin, ref_sin)):
        assert (got.float() - want).abs().max() <= 2.0**-8  # bf16's rounding of values in [-1, 1]
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())


# ---- the benchmark script -----------------------------------------------------------------------


def run_benchmark(tmp_path, *args: str) -> dict:
    import json

    import real_models

    out = tmp_path / "rows.json"
    code = real_models.main(["--tiny", "--device", "cpu", "--threads", "1", "--steps", "1", "--warmup", "1",
                             "--json", str(out), "--markdown", str(tmp_path / "rows.md"), *args])
    with open(out) as f:
        return {"code": code, **json.load(f)}


def test_benchmark_runs_a_model_beside_its_peer(tmp_path):
    spec_of("gpt2")
    data = run_benchmark(tmp_path, "--models", "gpt2", "--levels", "O2-bf16", "--profile", "--profile-steps", "1")
    assert data["code"] == 0
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["torch-bf16", "mixprec-O2-bf16"]
    row = rows["mixprec-O2-bf16"]
    assert row["status"] == "ok" and row["peer"] == "torch-bf16" and row["skipped_steps"] == 0
    assert row["per_s"] > 0 and math.isfinite(row["loss"]) and math.isfinite(row["speed_vs_peer"])
    # The same weights and batches: after one update the losses differ by bf16's rounding only.
    assert abs(row["loss_vs_peer_pct"]) < 1.0
    assert set(row["profile"]["phases"]) == {"forward", "backward", "loss_scale", "optimizer"}
    assert "| mixprec-O2-bf16 |" in (tmp_path / "rows.md").read_text()


def test_benchmark_names_a_missing_library_and_runs_the_rest(tmp_path, monkeypatch, capsys):
    spec_of("gpt2")
    import real_models

    monkeypatch.setattr(real_models, "import_libraries", lambda: {"timm": "ModuleNotFoundError: No module named 'timm'"})
    data = run_benchmark(tmp_path, "--models", "vit,gpt2", "--levels", "O2-bf16")
    err = capsys.readouterr().err
    assert "timm is not available" in err and "skipping vit" in err and zoo.INSTALL_HINT in err
    assert {r["model"] for r in data["results"]} == {"gpt2"} and data["code"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--models", "gpt3"], "--models: unknown model(s) ['gpt3']"),
    (["--levels", "O4"], "--levels: unknown level 'O4'"),
    (["--levels", "O2-fp8"], "--levels: unknown level 'O2-fp8'"),
    (["--steps", "0"], "--steps and --profile-steps must be >= 1"),
])
def test_benchmark_refuses_bad_arguments(argv, message, capsys):
    import real_models

    with pytest.raises(SystemExit) as exc:
        real_models.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
