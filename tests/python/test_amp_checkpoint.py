# Checkpoints under mixprec.amp: checkpoint_state/load_checkpoint_state resume bit-identically at
# every level (masters included), load with torch.load(weights_only=True), and reject corrupt or
# mismatched checkpoints without changing anything; Apex's own recipe (model/optimizer/amp
# state_dicts) still works; amp.state_dict round trips.
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from amp_support import (
    LEVELS,
    OPT_KINDS,
    fresh,
    injections,
    make_batches,
    make_model,
    make_optimizers,
    one_cpu_thread,  # noqa: F401  (autouse fixture)
    train_amp,
)
from conftest import assert_bitwise_equal
from mixprec import amp


def init(model0, kind, level, dtype, n_losses=1):
    model = fresh(model0)
    opts = make_optimizers(kind, model)
    return amp.initialize(model, opts, opt_level=level, dtype=dtype, loss_scale="dynamic", max_loss_scale=2.0**8,
                          num_losses=n_losses, verbosity=0)


def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def optimizer_tensors(opts):
    out = []
    for o in opts:
        sd = o.state_dict()
        for pid in sorted(sd["state"]):
            for k in sorted(sd["state"][pid]):
                v = sd["state"][pid][k]
                if isinstance(v, torch.Tensor):
                    out.append((f"state[{pid}][{k}]", v.detach().clone()))
        for gi, g in enumerate(sd["param_groups"]):
            if isinstance(g.get("step"), torch.Tensor):
                out.append((f"group{gi}.step", g["step"].detach().clone()))
    return out


def everything(model, opts):
    """Params and buffers, optimizer state, masters and scalers: what must match bit for bit."""
    items = [(f"model.{k}", v.detach().clone()) for k, v in model.state_dict().items()]
    items += [(f"param.{i}", p.detach().clone()) for i, p in enumerate(model.parameters())]
    items += optimizer_tensors(opts)
    for oi, o in enumerate(opts):
        items += [(f"master{oi}.{j}", m.detach().clone()) for j, m in enumerate(amp.master_params(o))]
    return items, amp.state_dict()


def assert_same(a, b, what):
    items_a, amp_a = a
    items_b, amp_b = b
    assert [k for k, _ in items_a] == [k for k, _ in items_b], what
    for (k, va), (_, vb) in zip(items_a, items_b):
        assert_bitwise_equal(va, vb, f"{what}: {k}")
    assert amp_a == amp_b, what


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", OPT_KINDS)
def test_resume_is_bit_identical(level, dtype, kind, gen):
    model0 = make_model(gen, "cpu")
    batches = make_batches(gen, "cpu", 6, 1)
    inject = injections(1, 1)  # overflows at steps 2 and 4: one before, one after the checkpoint
    first = {k: v for k, v in inject.items() if k[0] < 3}
    later = {(s - 3, mb, lid): v for (s, mb, lid), v in inject.items() if s >= 3}

    model, opts = init(model0, kind, level, dtype)
    train_amp(model, opts, batches, 1, inject)
    straight = everything(model, opts)

    model, opts = init(model0, kind, level, dtype)
    train_amp(model, opts, batches[:3], 1, first)
    ckpt = save_load(amp.checkpoint_state(model, opts))

    model, opts = init(model0, kind, level, dtype)  # a new process would start like this
    amp.load_checkpoint_state(ckpt, model, opts)
    train_amp(model, opts, batches[3:], 1, later)
    assert_same(everything(model, opts), straight, f"{level}/{dtype}/{kind} resumed")
    assert amp.skipped_steps() == 2


@pytest.mark.parametrize("kind", ["fused", "torch"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_recipe_with_state_dicts(kind, level, gen):
    # Apex's documented checkpointing: model.state_dict(), optimizer.state_dict(), amp.state_dict().
    # Exact where the optimizer holds the masters (O1; O2 with FusedAdam); under O2 with another
    # optimizer the masters come back from the fp16 model, as in Apex, so only close.
    model0 = make_model(gen, "cpu")
    batches = make_batches(gen, "cpu", 5, 1)
    model, opts = init(model0, kind, level, torch.float16)
    train_amp(model, opts, batches, 1, {})
    straight = everything(model, opts)

    model, opts = init(model0, kind, level, torch.float16)
    train_amp(model, opts, batches[:2], 1, {})
    ckpt = save_load({"model": model.state_dict(), "optimizer": opts[0].state_dict(), "amp": amp.state_dict()})
    model, opts = init(model0, kind, level, torch.float16)
    model.load_state_dict(ckpt["model"])
    opts[0].load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    train_amp(model, opts, batches[2:], 1, {})
    resumed = everything(model, opts)
    if level == "O2" and kind == "torch":
        got = torch.cat([p.float().flatten() for p in model.parameters()])
        want = torch.cat([v.float().flatten() for k, v in straight[0] if k.startswith("param.")])
        assert torch.allclose(got, want, rtol=0, atol=1e-2)
    else:
        assert_same(resumed, straight, f"Apex recipe {level}/{kind}")


def test_amp_state_dict_keeps_apex_keys_and_round_trips(gen):
    model0 = make_model(gen, "cpu")
    model, opts = init(model0, "torch", "O1", torch.float16, n_losses=2)
    train_amp(model, opts, make_batches(gen, "cpu", 5, 1), 2, injections(2, 1))
    sd = amp.state_dict()
    assert sorted(sd) == ["loss_scaler0", "loss_scaler1"]
    assert {"loss_scale", "unskipped"} <= sd["loss_scaler0"].keys()
    assert sd["loss_scaler0"]["_skipped_steps"] == 1 and sd["loss_scaler1"]["_skipped_steps"] == 1
    loaded = save_load(sd)
    init(model0, "torch", "O1", torch.float16, n_losses=2)
    amp.load_state_dict(loaded)
    assert amp.state_dict() == sd
    # Apex's own format (no mixprec keys) loads too.
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 7},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    assert amp.loss_scale(0) == 128.0 and amp.state_dict()["loss_scaler0"]["unskipped"] == 7
    with pytest.raises(RuntimeError, match="Unexpected key"):
        amp.load_state_dict({"loss_scaler0": sd["loss_scaler0"], "bogus": {}})
    # Above this run's max_loss_scale (2**8): refused, where Apex took it and skipped steps until
    # the scale came back down.
    with pytest.raises(ValueError, match=r"\['loss_scale'\] must be <= max_scale \(256.0\)"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7},
                             "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    assert amp.loss_scale(0) == 128.0


CORRUPTIONS = {
    "not a dict": lambda c: [],
    "wrong format": lambda c: c.update(format="apex"),
    "wrong version": lambda c: c.update(version=99),
    "missing amp": lambda c: c.pop("amp"),
    "other opt level": lambda c: c.update(opt_level="O1"),
    "other dtype": lambda c: c.update(dtype="bfloat16"),
    "model key missing": lambda c: c["models"][0].pop(next(iter(c["models"][0]))),
    "model key extra": lambda c: c["models"][0].update(extra=torch.zeros(1)),
    "model shape": lambda c: c["models"][0].update({"0.weight": torch.zeros(3, 3)}),
    "two models": lambda c: c["models"].append(c["models"][0]),
    "optimizer groups": lambda c: c["optimizers"][0]["param_groups"].append(c["optimizers"][0]["param_groups"][0]),
    "optimizer state shape": lambda c: next(iter(c["optimizers"][0]["state"].values())).update(
        exp_avg=torch.zeros(2)),
    "optimizer unknown param": lambda c: c["optimizers"][0]["state"].update({99: {}}),
    "masters count": lambda c: c["masters"][0].append(torch.zeros(1)),
    "master dtype": lambda c: c["masters"][0].__setitem__(0, c["masters"][0][0].half()) if c["masters"][0] else
    c["masters"].__setitem__(0, [torch.zeros(1)]),
    "scaler value": lambda c: c["amp"]["loss_scaler0"].update(loss_scale=-1.0),
    "scaler count": lambda c: c["amp"].update(loss_scaler1=c["amp"]["loss_scaler0"]),
    "scaler tracker": lambda c: c["amp"]["loss_scaler0"].update(unskipped=1.5),
}


@pytest.mark.parametrize("kind", ["torch", "fused"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_checkpoint_raises_and_changes_nothing(kind, corruption, gen):
    model0 = make_model(gen, "cpu")
    batches = make_batches(gen, "cpu", 3, 1)
    model, opts = init(model0, kind, "O2", torch.float16)
    train_amp(model, opts, batches[:2], 1, {(1, 0, 0): (0, math.inf)})
    ckpt = save_load(amp.checkpoint_state(model, opts))
    train_amp(model, opts, batches[2:], 1, {})  # move on, so a partial load would show
    before = everything(model, opts)
    bad = copy.deepcopy(ckpt)
    result = CORRUPTIONS[corruption](bad)
    if corruption == "not a dict":
        bad = result
    with pytest.raises((ValueError, RuntimeError)):
        amp.load_checkpoint_state(bad, model, opts)
    assert_same(everything(model, opts), before, f"after rejecting '{corruption}'")
    amp.load_checkpoint_state(ckpt, model, opts)  # the intact one still loads
