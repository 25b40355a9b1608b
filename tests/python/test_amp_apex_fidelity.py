# Apex 25.04 behaviours an Apex-era script relies on (issue 19's sweep), each checked by what it does:
# the loss scalers' attributes resume code sets and reads, keep_batchnorm_fp32 under O2, several
# losses with their own scales and checkpoint entries, and the norms without affine parameters.
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from amp_support import amp_world, assert_same_world, make_model, one_cpu_thread  # noqa: F401  (autouse)
from conftest import assert_rel_err, random_tensor
from mixprec import amp
from mixprec.apex_compat import normalization as N


def batch(gen):
    return random_tensor((16, 8), torch.float32, "cpu", gen, scale=0.1)


#: O2's scale capped at 2**10 (it starts at min(max_loss_scale, 2**16)): the scaled float16
#: gradients must not overflow of themselves (BatchNorm's backward amplifies them), so that only
#: the injected inf/NaN decides which step and loss overflow.
CAP = dict(max_loss_scale=2.0**10)
S = 2.0**10


def block(model, opt, gen, loss_id=0, poison=None, retain=False, out=None):
    out = model(batch(gen)) if out is None else out
    loss = out.float().pow(2).mean() * (1.0 + 0.25 * loss_id)
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward(retain_graph=retain)
        if poison is not None:
            model[0].weight.grad.view(-1)[5] = poison
    return out


# -- the loss scalers' Apex attributes -------------------------------------------------------------------
def test_unskipped_is_settable_as_apex_resume_code_does(gen):
    """Apex's load_state_dict (and resume code modelled on it) sets ``_unskipped``; mixprec's was
    read-only (AttributeError). 1999 clean steps counted: the next clean step doubles the scale."""
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = S  # (below the cap that growth needs, and small enough not to overflow)
    scaler._unskipped = 1998  # before the scale's device values exist: kept for them
    block(model, opt, gen)
    opt.step()
    assert scaler._unskipped == 1999 and amp.loss_scale() == S
    scaler._unskipped = 1999  # on the device now: a fill
    opt.zero_grad()
    block(model, opt, gen)
    opt.step()
    assert amp.loss_scale() == 2 * S and scaler._unskipped == 0
    before = amp_world([model], [opt])
    for bad in (-1, 2**31, 1.5, "7", math.nan):
        with pytest.raises(ValueError, match=r"amp loss scaler 0: _unskipped must be an integer >= 0"):
            scaler._unskipped = bad
    assert_same_world(before, amp_world([model], [opt]))


def test_has_overflow_reports_the_last_update_as_apex_did(gen):
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, **CAP)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler._has_overflow is False  # nothing checked yet
    block(model, opt, gen, poison=math.inf)
    assert scaler._has_overflow is True
    opt.step()
    assert scaler._has_overflow is True  # until the next update, as Apex's flag stayed
    opt.zero_grad()
    block(model, opt, gen)
    assert scaler._has_overflow is False
    block(model, opt, gen, poison=math.nan)
    scaler.clear_overflow_state()
    assert scaler._has_overflow is False
    # A static scale is not checked (Apex's neither).
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    block(model, opt, gen, poison=math.inf)
    assert amp._amp_state.loss_scalers[0]._has_overflow is False


# -- keep_batchnorm_fp32 under O2 ----------------------------------------------------------------------
@pytest.mark.parametrize("keep", [True, False, "False"], ids=["kept", "cast", "cast_by_string"])
def test_keep_batchnorm_fp32_decides_batchnorms_dtype_and_master(keep, gen):
    """Apex: kept (O2's default) the BatchNorm stays fp32 and is its own master; cast, it is float16
    with an fp32 master like every other layer. One SGD step, checked against the step written
    out: master - lr * (float16 gradient / scale), and the model the master's float16 copy."""
    model = make_model(gen, "cpu")
    fp32 = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=keep, verbosity=0, **CAP)
    kept = keep is True
    bn = model[1]
    assert bn.weight.dtype == (torch.float32 if kept else torch.float16)
    assert bn.running_mean.dtype == (torch.float32 if kept else torch.float16)
    masters = list(amp.master_params(opt))
    assert [m.dtype for m in masters] == [torch.float32] * 5
    assert (masters[1] is bn.weight) == kept and (masters[2] is bn.bias) == kept
    assert all(torch.equal(m, fp32[name]) for m, (name, _) in zip(masters, model.named_parameters()))
    block(model, opt, gen)
    scale = amp.loss_scale()
    grads = [p.grad.detach().float() * (1.0 / scale) if p.dtype == torch.float16 else p.grad.detach().clone()
             for p in model.parameters()]
    want = [torch.add(m.detach(), g, alpha=-0.1) for m, g in zip(masters, grads)]
    opt.step()
    for (name, p), m, w in zip(model.named_parameters(), masters, want):
        assert torch.equal(m, w), name
        assert torch.equal(p, w.to(p.dtype)), name


# -- several losses: each its own scale, skip and checkpoint entry ----------------------------------------
def test_each_loss_id_keeps_its_own_scale_and_checkpoint_entry(gen):
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=3, verbosity=0, **CAP)
    out = None
    for loss_id in range(3):  # an overflow in loss 1's backward only
        out = block(model, opt, gen, loss_id, poison=math.inf if loss_id == 1 else None, retain=loss_id < 2, out=out)
    weights = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))  # skipped: every loss's step
    assert [amp.loss_scale(i) for i in range(3)] == [S, S / 2, S]
    assert [amp.skipped_steps(i) for i in range(3)] == [0, 1, 0] and amp.skipped_steps() == 1
    opt.zero_grad()
    out = None
    for loss_id in range(3):
        out = block(model, opt, gen, loss_id, retain=loss_id < 2, out=out)
    opt.step()
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    amp._amp_state.loss_scalers[2]._unskipped = 77
    saved = amp.state_dict()
    assert sorted(saved) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert [(saved[f"loss_scaler{i}"]["loss_scale"], saved[f"loss_scaler{i}"]["unskipped"]) for i in range(3)] == \
        [(S, 2), (S / 2, 1), (S, 77)]  # two clean updates; an overflow and one; set
    # A fresh initialize with three losses takes each entry back to its own scaler.
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp.initialize(model, opt, opt_level="O2", num_losses=3, verbosity=0, **CAP)
    amp.load_state_dict(saved)
    assert amp.state_dict() == saved


# -- the norms without affine parameters ---------------------------------------------------------------------
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_norms_without_elementwise_affine_normalize(device, gen, rms, dtype):
    """elementwise_affine=False: no parameters, the plain normalization (values and input gradient
    against float64 torch), as Apex's FusedLayerNorm / FusedRMSNorm compute it."""
    cls = N.FusedRMSNorm if rms else N.FusedLayerNorm
    m = cls((5, 33), eps=1e-5, elementwise_affine=False)
    assert list(m.parameters()) == []
    x = random_tensor((3, 5, 33), dtype, device, gen, scale=3.0)
    xi = x.detach().clone().requires_grad_()
    out = m(xi)
    assert out.dtype == dtype and out.shape == x.shape
    x64 = x.double().requires_grad_()
    ref = F.rms_norm(x64, [5, 33], eps=1e-5) if rms else F.layer_norm(x64, [5, 33], eps=1e-5)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert_rel_err(out, ref, bound, "output")
    dy = random_tensor(x.shape, dtype, device, gen)
    out.backward(dy)
    ref.backward(dy.double())
    assert_rel_err(xi.grad, x64.grad, bound, "grad input")
