# Tests of mixprec's apex.parallel.LARC (mixprec.apex_compat.LARC): the adaptive rate against a
# float64 re-implementation of Apex's documented rule, pass-through of the inner optimizer,
# state_dict round trips, and refused input changing nothing.
from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

from conftest import assert_rel_err, assert_unchanged, random_tensor, snapshot
from mixprec.apex_compat import LARC


def make_params(gen, device, dtype=torch.float32):
    shapes = [(3, 5), (70000,), (4,), (2, 2)]
    ps = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in shapes]
    with torch.no_grad():
        ps[3].zero_()  # ||p|| == 0: Apex leaves its gradient alone (and adds no decay)
    return ps


def set_grads(params, gen, device, skip=2):
    for i, p in enumerate(params):
        p.grad = None if i == skip else random_tensor(p.shape, p.dtype, device, gen, 0.1)


def larc_sgd_reference(params, grads, bufs, groups, tc, clip, eps, momentum):
    """One LARC step around SGD(momentum, weight decay handled by LARC), in float64."""
    for group in groups:
        lr, wd = group["lr"], group["weight_decay"]
        for i in group["idx"]:
            g = grads[i]
            if g is None:
                continue
            p = params[i]
            pn, gn = p.norm().item(), g.norm().item()
            if pn != 0 and gn != 0:
                a = tc * pn / (gn + pn * wd + eps)
                if clip:
                    a = min(a / lr, 1.0)
                g = (g + wd * p) * a
            bufs[i] = g.clone() if bufs[i] is None else momentum * bufs[i] + g
            params[i] = p - lr * bufs[i]


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_larc_vs_float64(device, gen, clip, dtype):
    params = make_params(gen, device, dtype)
    groups = [{"params": params[:2], "lr": 0.1, "weight_decay": 1e-2}, {"params": params[2:], "lr": 0.5}]
    opt = LARC(torch.optim.SGD(groups, lr=0.3, momentum=0.9), trust_coefficient=0.02, clip=clip, eps=1e-8)
    ref = [p.detach().double().cpu() for p in params]
    bufs = [None] * len(params)
    ref_groups = [{"idx": [0, 1], "lr": 0.1, "weight_decay": 1e-2}, {"idx": [2, 3], "lr": 0.5, "weight_decay": 0.0}]
    for step in range(3):
        set_grads(params, gen, device, skip=2 if step else 1)
        if step == 1:
            params[0].grad.zero_()  # ||g|| == 0 with weight decay: Apex folds no decay in either
        grads = [None if p.grad is None else p.grad.double().cpu() for p in params]
        opt.step()
        larc_sgd_reference(ref, grads, bufs, ref_groups, 0.02, clip, 1e-8, 0.9)
        assert [g["weight_decay"] for g in opt.param_groups] == [1e-2, 0]
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    for i, (p, r) in enumerate(zip(params, ref)):
        assert_rel_err(p, r, tol, f"param {i}")


def test_weight_decay_is_folded_and_zeroed_during_the_inner_step(gen):
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append([g["weight_decay"] for g in self.param_groups])
            grads.extend(p.grad.clone() for p in self.param_groups[0]["params"])

    grads = []
    p = torch.nn.Parameter(random_tensor(50, torch.float32, "cpu", gen))
    p.grad = random_tensor(50, torch.float32, "cpu", gen)
    g0 = p.grad.clone()
    opt = LARC(Spy([p], lr=0.1, weight_decay=0.5), trust_coefficient=0.1, clip=False)
    opt.step()
    assert seen == [[0]] and opt.param_groups[0]["weight_decay"] == 0.5
    pn, gn = p.detach().double().norm(), g0.double().norm()
    expected = (g0.double() + 0.5 * p.detach().double()) * (0.1 * pn / (gn + 0.5 * pn + 1e-8))
    assert_rel_err(grads[0], expected, 1e-6, "rescaled grad")


def test_passes_the_inner_optimizer_through(gen):
    ps = make_params(gen, "cpu")
    inner = torch.optim.SGD(ps[:2], lr=0.1, momentum=0.9)
    opt = LARC(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and repr(opt) == repr(inner)
    opt.add_param_group({"params": ps[2:], "lr": 0.2})
    assert len(inner.param_groups) == 2
    set_grads(ps, gen, "cpu", skip=-1)
    opt.zero_grad()
    assert all(p.grad is None for p in ps)
    assert opt.__getstate__() == inner.__getstate__()
    opt.param_groups = inner.param_groups
    state = inner.__getstate__()
    opt.__setstate__(state)
    assert inner.defaults is state["defaults"]


def test_state_dict_round_trip_and_copies(gen):
    def build(ps):
        return LARC(torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3), trust_coefficient=0.05)

    a = make_params(gen, "cpu")
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = build(a), build(b)
    set_grads(a, gen, "cpu", skip=-1)
    opt_a.step()
    sd = opt_a.state_dict()
    assert sd == opt_a.optim.state_dict()
    for pa, pb in zip(a, b):
        with torch.no_grad():
            pb.copy_(pa)
    opt_b.load_state_dict(copy.deepcopy(sd))
    set_grads(a, gen, "cpu", skip=-1)
    for pa, pb in zip(a, b):
        pb.grad = pa.grad.clone()
    opt_a.step()
    opt_b.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
    for clone in (copy.deepcopy(opt_a), pickle.loads(pickle.dumps(opt_a))):
        assert isinstance(clone, LARC) and clone.trust_coefficient == 0.05 and clone.clip and clone.eps == 1e-8
        assert clone.state_dict()["param_groups"] == opt_a.state_dict()["param_groups"]


@pytest.mark.parametrize("kwargs,match", [({"trust_coefficient": -1.0}, "LARC: invalid trust_coefficient -1.0"),
                                          ({"eps": math.nan}, "LARC: invalid eps nan")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LARC(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), **kwargs)
    with pytest.raises(TypeError, match="LARC: optimizer must be an optimizer"):
        LARC(object())


@pytest.mark.parametrize("group_update,match", [({"weight_decay": -0.1}, "param group 1: invalid weight_decay -0.1"),
                                                ({"lr": 0.0}, "param group 1: invalid lr 0.0")])
def test_a_refused_step_changes_nothing(gen, group_update, match):
    ps = make_params(gen, "cpu")
    opt = LARC(torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.1, momentum=0.9, weight_decay=0.1))
    set_grads(ps, gen, "cpu")
    opt.step()  # momentum state exists
    set_grads(ps, gen, "cpu")
    opt.param_groups[1].update(group_update)
    tensors = list(ps) + [p.grad for p in ps if p.grad is not None] + \
        [s["momentum_buffer"] for s in opt.state.values()]
    before, groups = snapshot(tensors), copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                        for g in opt.param_groups])
    with pytest.raises(ValueError, match="LARC.step: " + match):
        opt.step()
    assert_unchanged(before, tensors, "refused step")
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.cuda
def test_step_has_no_host_sync(gen):
    class NoOp(torch.optim.Optimizer):
        def step(self, closure=None):
            pass

    ps = make_params(gen, "cuda")
    set_grads(ps, gen, "cuda")
    opt = LARC(NoOp(ps, {"lr": 0.1, "weight_decay": 0.01}))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_amp_takes_larc_as_its_optimizer(opt_level):
    # Apex's amp.initialize, amp.scale_loss and amp.master_params take a LARC-wrapped optimizer as
    # they take the optimizer itself (LARC wraps one without being a torch.optim.Optimizer).
    from mixprec import amp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.125))
    # A static scale: at 2**16 the fp16 gradients of O2/O3 would overflow and the step be skipped.
    model, opt = amp.initialize(model, larc, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    assert opt is larc
    before = [p.detach().float().clone() for p in amp.master_params(opt)]
    opt.zero_grad()
    loss = model(torch.randn(5, 4)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    with amp.scale_loss(loss * 0, [opt]):  # a list holding it is taken too
        pass
    masters = list(amp.master_params(opt))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in masters)
    opt.step()
    after = [p.detach().float() for p in amp.master_params(opt)]
    assert all(not torch.equal(b, a) for b, a in zip(before, after))


def test_amp_still_refuses_what_is_not_an_optimizer():
    from mixprec import amp

    model = torch.nn.Linear(4, 3)
    with pytest.raises(TypeError, match="optimizers must be"):
        amp.initialize(model, object(), opt_level="O0", verbosity=0)
    with pytest.raises(TypeError, match="master_params"):
        amp.master_params(object())
