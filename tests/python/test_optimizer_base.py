# Tests of mixprec.optimizers.FusedOptimizer, the base of every fused optimizer: step plumbing,
# master weights, GradScaler hand-off, Apex's legacy API, and validated checkpoints (via FusedAdam).
from __future__ import annotations

import copy
import io

import pytest
import torch

from conftest import assert_bitwise_equal, random_tensor
from mixprec.optimizers import FusedAdam, FusedOptimizer
from mixprec.optimizers._rules import MOMENT


class Recorder(FusedOptimizer):
    """A minimal subclass: plain SGD on the weights (masters when kept), recording what the base
    hands to _step_group, so the base's plumbing is tested apart from any kernel."""

    _state_rules = {"buf": MOMENT}
    _scalar_state_keys = ("count",)

    def __init__(self, params, lr=0.1, **kw):
        super().__init__(params, dict(lr=lr), **kw)
        self.calls = []

    def _init_state(self, p, group, state):
        state["buf"] = torch.zeros_like(p, dtype=torch.float32)
        state["count"] = 0

    def _step_group(self, group, params, **scalars):
        self.calls.append(dict(scalars, params=list(params), group=group))
        if scalars["found_inf"] is not None and scalars["found_inf"].item() != 0:
            return
        lr = scalars["lr_tensor"].item() if scalars["lr_tensor"] is not None else scalars["lr"]
        inv = 1.0 / scalars["grad_scale"].item() if scalars["grad_scale"] is not None else 1.0
        weights = self._masters(params, group) or params
        for p, w in zip(params, weights):
            w.sub_(lr * inv * p.grad.float())
            if w is not p:
                p.copy_(w)
            self.state[p]["count"] += 1
        scalars["step_tensor"].add_(1)


def leaf(values, dtype, device):
    return torch.nn.Parameter(values.to(dtype).to(device, copy=True))


# ---- step plumbing ------------------------------------------------------------------------------


def test_step_hands_group_scalars_to_subclass(device, gen):
    """One _step_group per group with grads: only params with a grad, a persistent float32 step
    tensor on the params' device, the host lr; masters only for non-fp32 params."""
    p32, p16, idle = (leaf(random_tensor(5, torch.float64, "cpu", gen), dt, device)
                      for dt in (torch.float32, torch.float16, torch.float32))
    lonely = leaf(random_tensor(3, torch.float64, "cpu", gen), torch.float32, device)
    opt = Recorder([dict(params=[p32, p16, idle]), dict(params=[lonely], lr=0.5)], master_weights=True)
    for k in range(2):
        p32.grad = torch.ones_like(p32)
        p16.grad = torch.ones_like(p16)
        opt.step()
        assert len(opt.calls) == k + 1, "the group without grads must be skipped"
        call = opt.calls[-1]
        assert call["params"] == [p32, p16]
        st = call["step_tensor"]
        assert st is opt.param_groups[0]["step"] and st.dtype == torch.float32 and st.shape == (1,)
        assert st.device == p32.device and st.item() == k + 1
        assert call["lr"] == 0.1 and call["lr_tensor"] is None
        assert call["grad_scale"] is None and call["found_inf"] is None
    assert "step" not in opt.param_groups[1] and len(opt.state[lonely]) == 0 and len(opt.state[idle]) == 0
    assert "master_param" not in opt.state[p32]
    master = opt.state[p16]["master_param"]
    assert master.dtype == torch.float32 and master.device == p16.device
    assert_bitwise_equal(p16.detach(), master.half(), "model copy")
    assert list(opt.master_params()) == [p32, master, idle, lonely]


def test_lr_tensor_reaches_the_device(device):
    """A tensor lr (on the CPU here) is handed over as a float32 one-element tensor on the device."""
    p = leaf(torch.ones(4), torch.float32, device)
    opt = Recorder([p], lr=torch.tensor(0.25))
    p.grad = torch.ones_like(p)
    opt.step()
    lr_tensor = opt.calls[-1]["lr_tensor"]
    assert lr_tensor.device == p.device and lr_tensor.dtype == torch.float32 and lr_tensor.shape == (1,)
    assert lr_tensor.item() == 0.25
    assert torch.equal(p.detach().cpu(), torch.full((4,), 0.75))


def test_zero_grad_follows_set_grad_none():
    for set_grad_none, expect_none in ((True, True), (False, False)):
        p = torch.nn.Parameter(torch.ones(3))
        opt = Recorder([p], set_grad_none=set_grad_none)
        p.grad = torch.full((3,), 2.0)
        opt.zero_grad()
        assert (p.grad is None) == expect_none
        if not expect_none:
            assert torch.equal(p.grad, torch.zeros(3))
    p.grad = torch.ones(3)
    opt.zero_grad(set_to_none=True)  # an explicit argument wins
    assert p.grad is None


@pytest.mark.parametrize("legacy", ["grads", "output_params", "scale", "grad_norms", "grad_scaler"])
def test_apex_legacy_step_arguments_raise(legacy):
    """Apex's old FusedAdam.step(grads=..., output_params=..., scale=...) API is gone: a clear
    TypeError that says so, and nothing stepped."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = FusedAdam([p])
    with pytest.raises(TypeError, match="Apex"):
        opt.step(**{legacy: [p.grad]})
    with pytest.raises(TypeError, match="unexpected"):
        opt.step(not_an_argument=1)
    assert torch.equal(p.detach(), torch.ones(3)) and len(opt.state[p]) == 0


def test_closure_runs_with_grad_and_its_loss_is_returned():
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=0.1)

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert bool((p.detach() < 1).all())


def test_sparse_grads_rejected():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdam([p]).step()
    assert torch.equal(p.detach(), torch.ones(4))


@pytest.mark.cuda
def test_group_mixing_devices_rejected():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, device="cuda"))
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(ValueError, match="devices"):
        FusedAdam([a, b]).step()


# ---- GradScaler hand-off ------------------------------------------------------------------------


def test_grad_scaler_hands_scale_and_found_inf(device):
    """torch.amp.GradScaler sees _step_supports_amp_scaling and sets grad_scale/found_inf on the
    optimizer for the step (removing them after); the base passes them on as float32 one-element
    tensors on the params' device, and the grads stay scaled."""
    assert FusedOptimizer._step_supports_amp_scaling and FusedAdam._step_supports_amp_scaling
    p = leaf(torch.ones(4), torch.float32, device)
    opt = Recorder([p], lr=0.5)
    scaler = torch.amp.GradScaler(device, init_scale=64.0)
    for k, bad in enumerate((False, True, False)):
        opt.zero_grad()
        scaler.scale((p * 2.0).sum()).backward()
        scale = scaler.get_scale()
        if bad:
            p.grad[1] = float("inf")
        scaler.step(opt)
        call = opt.calls[-1]
        for name, value in (("grad_scale", scale), ("found_inf", float(bad))):
            t = call[name]
            assert t.device == p.device and t.dtype == torch.float32 and t.numel() == 1, name
            assert t.item() == value, name
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        if not bad:
            assert torch.equal(p.grad.cpu(), torch.full((4,), 2.0 * scale)), "grads were unscaled in place"
        scaler.update()
    assert opt.param_groups[0]["step"].item() == 2
    assert torch.equal(p.detach().cpu(), torch.full((4,), 1.0 - 2 * 0.5 * 2.0))


# ---- checkpoints --------------------------------------------------------------------------------


def trained_adam(device, gen, *, dtype=torch.float16, master_weights=True, steps=3, amsgrad=True):
    """A FusedAdam with two groups, fp32 masters of fp16 params, and a few steps taken."""
    ps = [leaf(random_tensor(s, torch.float64, "cpu", gen), dtype, device) for s in ((4, 3), (7,), (2,))]
    opt = FusedAdam([dict(params=ps[:2], amsgrad=amsgrad), dict(params=ps[2:], lr=3e-3, weight_decay=0.1)],
                    master_weights=master_weights)
    for _ in range(steps):
        for p in ps:
            p.grad = random_tensor(p.shape, dtype, device, gen)
        opt.step()
    return ps, opt


def capture(opt):
    """Everything an optimizer holds, cloned: groups (tensors cloned) and per-param state."""
    groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
              for g in opt.param_groups]
    params = [[id(p) for p in g["params"]] for g in opt.param_groups]
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    return groups, params, state


def assert_captured_equal(a, b, what):
    (ga, pa, sa), (gb, pb, sb) = a, b
    assert pa == pb, f"{what}: params"
    assert [sorted(g) for g in ga] == [sorted(g) for g in gb], f"{what}: group keys"
    for i, (x, y) in enumerate(zip(ga, gb)):
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert_bitwise_equal(x[k], y[k], f"{what}: group {i} {k}")
            else:
                assert x[k] == y[k], f"{what}: group {i} {k}"
    assert sorted(sa) == sorted(sb), f"{what}: state params"
    for pid in sa:
        assert sorted(sa[pid]) == sorted(sb[pid]), f"{what}: state keys"
        for k, v in sa[pid].items():
            if isinstance(v, torch.Tensor):
                assert_bitwise_equal(v, sb[pid][k], f"{what}: state {k}")
            else:
                assert v == sb[pid][k]


def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_keeps_state_dtypes_and_devices(device, gen):
    """weights_only round trip into a fresh optimizer over fp16 params: fp32 moments and masters
    stay fp32 (torch's loader would cast them to the params' fp16) and land on the params' device."""
    ps, opt = trained_adam(device, gen)
    fresh = [leaf(p.detach().cpu(), p.dtype, device) for p in ps]
    new = FusedAdam([dict(params=fresh[:2], amsgrad=True), dict(params=fresh[2:])], master_weights=True)
    new.load_state_dict(save_load(opt.state_dict()))
    for p, q in zip(ps, fresh):
        for k, v in opt.state[p].items():
            assert new.state[q][k].dtype == v.dtype == torch.float32 and new.state[q][k].device == q.device
            assert_bitwise_equal(new.state[q][k], v, k)
    for g, h in zip(opt.param_groups, new.param_groups):
        assert h["step"].device == fresh[0].device
        assert_bitwise_equal(h["step"], g["step"], "step")
        assert h["lr"] == g["lr"] and h["weight_decay"] == g["weight_decay"], "the checkpoint's values win"


def test_loading_a_live_state_dict_shares_no_tensors(device, gen):
    """opt2.load_state_dict(opt1.state_dict()) without a file in between: stepping opt2 must not
    move opt1 (step counts, moments and masters are copies, not views)."""
    ps, opt1 = trained_adam(device, gen)
    twins = [leaf(p.detach().cpu(), p.dtype, device) for p in ps]
    opt2 = FusedAdam([dict(params=twins[:2], amsgrad=True), dict(params=twins[2:])], master_weights=True)
    opt2.load_state_dict(opt1.state_dict())
    before = capture(opt1)
    for q in twins:
        q.grad = random_tensor(q.shape, q.dtype, device, gen)
    opt2.step()
    assert_captured_equal(capture(opt1), before, "opt1 after stepping opt2")


def _corrupt(fn):
    def apply(sd):
        sd = copy.deepcopy(sd)
        fn(sd)
        return sd
    return apply


def _set_state(key, value_fn):
    return _corrupt(lambda sd: sd["state"][0].__setitem__(key, value_fn(sd["state"][0])))


# name: corruption of a valid FusedAdam state_dict (fp16 params, masters, amsgrad in group 0)
CORRUPTIONS = {
    "more_groups": _corrupt(lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][1]))),
    "fewer_groups": _corrupt(lambda sd: sd["param_groups"].pop()),
    "fewer_params": _corrupt(lambda sd: sd["param_groups"][0]["params"].pop()),
    "more_params": _corrupt(lambda sd: sd["param_groups"][1]["params"].append(99)),
    "moment_shape": _set_state("exp_avg", lambda s: torch.zeros(3, 4)),
    "master_shape": _set_state("master_param", lambda s: s["master_param"].flatten()),
    "master_fp16": _set_state("master_param", lambda s: s["master_param"].half()),
    "master_missing": _corrupt(lambda sd: sd["state"][0].pop("master_param")),
    "unknown_state_key": _set_state("momentum_buffer", lambda s: s["exp_avg"].clone()),
    "unknown_param_id": _corrupt(lambda sd: sd["state"].__setitem__(42, copy.deepcopy(sd["state"][0]))),
    "state_entry_not_dict": _corrupt(lambda sd: sd["state"].__setitem__(0, [1.0, 2.0])),
    "moment_not_tensor": _set_state("exp_avg", lambda s: s["exp_avg"].tolist()),
    "moment_int": _set_state("exp_avg_sq", lambda s: s["exp_avg_sq"].int()),
    "moment_fp16": _set_state("exp_avg", lambda s: s["exp_avg"].half()),
    "moment_fp64": _set_state("exp_avg_sq", lambda s: s["exp_avg_sq"].double()),
    "step_string": _corrupt(lambda sd: sd["param_groups"][0].__setitem__("step", "3")),
    "step_two_elements": _corrupt(lambda sd: sd["param_groups"][0].__setitem__("step", torch.ones(2))),
    "no_state": _corrupt(lambda sd: sd.pop("state")),
    "state_not_dict": _corrupt(lambda sd: sd.__setitem__("state", list(sd["state"].values()))),
    "group_not_dict": _corrupt(lambda sd: sd["param_groups"].__setitem__(1, [2])),
    "group_params_not_list": _corrupt(lambda sd: sd["param_groups"][1].__setitem__("params", 2)),
    "group_missing_hyper_parameter": _corrupt(lambda sd: sd["param_groups"][0].pop("betas")),
    "group_lr_string": _corrupt(lambda sd: sd["param_groups"][0].__setitem__("lr", "fast")),
    "group_bad_betas": _corrupt(lambda sd: sd["param_groups"][1].__setitem__("betas", (1.5, 0.9))),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_load_state_dict_rejects_corrupt_checkpoints(device, name, gen):
    """ValueError, and the optimizer is unchanged: same groups and state, and it steps exactly
    like an untouched twin afterwards."""
    ps, opt = trained_adam(device, gen)
    good = save_load(opt.state_dict())
    bad = CORRUPTIONS[name](good)
    before = capture(opt)
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert_captured_equal(capture(opt), before, f"after rejecting {name}")
    twins = [leaf(p.detach().cpu(), p.dtype, device) for p in ps]
    twin = FusedAdam([dict(params=twins[:2], amsgrad=True), dict(params=twins[2:])], master_weights=True)
    twin.load_state_dict(good)
    for p, q in zip(ps, twins):
        p.grad = random_tensor(p.shape, p.dtype, device, gen)
        q.grad = p.grad.clone()
    opt.step()
    twin.step()
    for p, q in zip(ps, twins):
        assert_bitwise_equal(p.detach(), q.detach(), "stepping after a rejected load")


@pytest.mark.parametrize("stepped", [True, False], ids=["stepped", "fresh"])
def test_torch_adamw_state_dict_is_refused(device, stepped, gen):
    """A torch.optim.AdamW checkpoint has another layout (per-param 'step', no master_param, no
    bias_correction/adam_w_mode): it must raise ValueError, never half-load, even when it holds no
    per-param state yet."""
    ps, opt = trained_adam(device, gen, dtype=torch.float32, master_weights=False, amsgrad=False)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    adamw = torch.optim.AdamW([dict(params=ref[:2]), dict(params=ref[2:], lr=3e-3)])
    if stepped:
        for q in ref:
            q.grad = torch.ones_like(q)
        adamw.step()
    before = capture(opt)
    with pytest.raises(ValueError):
        opt.load_state_dict(save_load(adamw.state_dict()))
    assert_captured_equal(capture(opt), before, "after refusing an AdamW checkpoint")


def test_scalar_state_round_trip():
    """Per-param scalar state (_scalar_state_keys) survives a weights_only round trip."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = Recorder([p])
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    new = Recorder([q])
    new.load_state_dict(save_load(opt.state_dict()))
    assert new.state[q]["count"] == 3 and new.param_groups[0]["step"].item() == 3


@pytest.mark.cuda
@pytest.mark.parametrize("src,dst", [("cpu", "cuda"), ("cuda", "cpu")])
def test_checkpoint_moves_to_the_params_device(src, dst, gen):
    ps, opt = trained_adam(src, gen)
    fresh = [leaf(p.detach().cpu(), p.dtype, dst) for p in ps]
    new = FusedAdam([dict(params=fresh[:2], amsgrad=True), dict(params=fresh[2:])], master_weights=True)
    new.load_state_dict(save_load(opt.state_dict()))
    assert all(t.device.type == dst for q in fresh for t in new.state[q].values())
    assert all(g["step"].device.type == dst for g in new.param_groups)
    for q in fresh:
        q.grad = torch.ones_like(q)
    new.step()
    assert all(g["step"].item() == 4 for g in new.param_groups)
