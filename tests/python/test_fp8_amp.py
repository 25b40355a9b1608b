# Tests of amp.initialize(..., fp8=True): bf16 O2 with the eligible Linears in FP8, the ineligible ones
# listed, training that tracks O2, and the FP8 scaling state in amp.state_dict() and checkpoints.
from __future__ import annotations

import io
import logging

import pytest
import torch
from conftest import random_tensor, rel_err

import mixprec
from mixprec import amp, fp8


def make_model(gen, device):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, scale=0.1))
    return model.to(device)


def train(model, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def batches_of(gen, device, steps=8):
    return [(random_tensor((32, 32), torch.float32, device, gen), random_tensor((32, 10), torch.float32, device, gen))
            for _ in range(steps)]


def test_fp8_is_bf16_o2_with_fp8_linears(device, gen, caplog):
    model = make_model(gen, device)
    peer = make_model(torch.Generator().manual_seed(0), device)
    peer.load_state_dict(model.state_dict())
    opt = mixprec.optimizers.FusedAdam(model.parameters(), lr=1e-2)
    peer_opt = mixprec.optimizers.FusedAdam(peer.parameters(), lr=1e-2)
    batches = batches_of(gen, device, 1) * 10  # one batch to fit: the loss must fall
    amp.initialize(peer, peer_opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    peer_losses = train(peer, peer_opt, batches)
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        model, opt = amp.initialize(model, opt, opt_level="O2", fp8=True)
    assert "fp8: models[0]: 2 nn.Linear in FP8" in caplog.text and "1 left in torch.bfloat16" in caplog.text
    assert "4: out_features=10 not a multiple of 16" in caplog.text
    assert [type(m).__name__ for m in model] == ["Fp8Linear", "GELU", "Fp8Linear", "GELU", "Linear"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert amp._amp_state.opt_properties.master_weights and amp._amp_state.dtype == torch.bfloat16
    losses = train(model, opt, batches)
    # FP8 operands (3 mantissa bits) against bf16's 8: the losses stay close to O2's, and differ.
    assert losses[-1] < 0.8 * losses[0]
    assert rel_err(torch.tensor(losses), torch.tensor(peer_losses)) < 0.05
    assert losses != peer_losses
    assert model[0].fp8_state.scale.ne(1).all()  # current scaling set every role's scale


def test_fp8_with_fp16_uses_dynamic_loss_scaling(gen):
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp.initialize(model, opt, opt_level="O2", fp8=True, dtype=torch.float16, verbosity=0)
    assert amp._amp_state.opt_properties.loss_scale == "dynamic" and model[0].weight.dtype == torch.float16


def fp8_layers_state():
    return {k: {n: t.clone() for n, t in v.items()} for k, v in amp.state_dict()["fp8"].items()}


def test_amp_state_dict_round_trip(device, gen):
    recipe = fp8.Fp8Recipe(scaling="delayed", amax_history_len=5)
    model = make_model(gen, device)
    fp8.convert(model, recipe)  # a custom recipe: convert first, then any cast level keeps it
    opt = mixprec.optimizers.FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert model[0].fp8_state.recipe is recipe
    batches = batches_of(gen, device, 4)
    train(model, opt, batches[:3])
    ckpt = amp.checkpoint_state(model, opt)
    buf = io.BytesIO()
    torch.save({"amp": amp.state_dict(), "ckpt": ckpt}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert set(saved["amp"]["fp8"]) == {"0.0", "0.2"}
    expected = fp8_layers_state()
    train(model, opt, batches[3:])  # moves the state on
    assert any(not torch.equal(expected["0.0"][k], v) for k, v in model[0].fp8_state.state_dict().items())
    amp.load_state_dict(saved["amp"])
    for name, state in fp8_layers_state().items():
        for k, v in state.items():
            assert torch.equal(v, expected[name][k]), f"{name}.{k}"
    # Through a full checkpoint too: models, masters, scalers and FP8 state together.
    train(model, opt, batches[3:])
    amp.load_checkpoint_state(saved["ckpt"], model, opt)
    assert torch.equal(model[2].fp8_state.amax_history, expected["0.2"]["amax_history"])


def test_bad_fp8_state_is_refused_and_changes_nothing(gen):
    model = make_model(gen, "cpu")
    opt = mixprec.optimizers.FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", fp8=True, verbosity=0)
    train(model, opt, batches_of(gen, "cpu", 2))
    good = amp.state_dict()
    before = fp8_layers_state()
    scale_before = good["loss_scaler0"]["loss_scale"]
    bad_scale = {**good["fp8"]["0.0"], "scale": torch.tensor([1.0, float("inf"), 2.0])}
    cases = [({**good, "fp8": {"0.0": good["fp8"]["0.0"]}}, ValueError, r"missing \['0.2'\]"),
             ({**good, "fp8": {**good["fp8"], "0.0": bad_scale}}, ValueError, r"\['fp8'\]\['0.0'\]\['scale'\]"),
             ({**good, "fp8": {**good["fp8"], "0.2": {**good["fp8"]["0.2"], "amax_history": torch.zeros(3, 2)}}},
              ValueError, "amax_history"),
             ({**good, "fp8": [1]}, ValueError, r"\['fp8'\] must be a dict"),
             ({**good, "fp8": {**good["fp8"], "0.0": {"scale": torch.ones(3)}}}, KeyError, "keys")]
    for bad, exc, pattern in cases:
        for k, v in good["fp8"]["0.0"].items():  # changes the live state, so a partial load would show
            getattr(model[0].fp8_state, k).add_(1)
        live = fp8_layers_state()
        with pytest.raises(exc, match=pattern):
            amp.load_state_dict({**bad, "loss_scaler0": {**good["loss_scaler0"], "loss_scale": 8.0}})
        for name, state in fp8_layers_state().items():
            for k, v in state.items():
                assert torch.equal(v, live[name][k]), f"a refused load changed {name}.{k}"
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale_before
    assert before  # the state existed all along


def test_o2_checkpoint_loads_with_fp8(gen):
    # An amp state without FP8 layers (plain O2's) loads into an FP8 run: the scales are rebuilt by current scaling.
    model = make_model(gen, "cpu")
    opt = mixprec.optimizers.FusedAdam(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level="O2", fp8=True, verbosity=0)
    amp.load_state_dict({"loss_scaler0": amp.state_dict()["loss_scaler0"]})


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(opt_level="O1", fp8=True), ValueError, "amp.initialize: fp8 needs a model cast"),
    (dict(opt_level="O0", fp8=fp8.Fp8Recipe()), ValueError, "opt_level O0 does not cast it"),
    (dict(opt_level="O2", fp8="e4m3"), TypeError, "amp.initialize: fp8 must be True, False, None or"),
    (dict(opt_level="O4", fp8=True), RuntimeError, "Unexpected optimization level"),
])
def test_bad_fp8_requests_are_refused_and_change_nothing(gen, kwargs, exc, match):
    model = make_model(gen, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(exc, match=match):
        amp.initialize(model, opt, verbosity=0, **kwargs)
    assert all(type(m) in (torch.nn.Linear, torch.nn.GELU) for m in model)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k])
    assert not hasattr(opt, "_amp_stash")


def test_recipe_passed_to_initialize(gen):
    model = make_model(gen, "cpu")
    recipe = fp8.Fp8Recipe.e4m3(scaling="delayed", amax_history_len=2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), opt_level="O3", fp8=recipe, verbosity=0)
    assert model[0].fp8_state.recipe is recipe and model[0].weight.dtype == torch.bfloat16
