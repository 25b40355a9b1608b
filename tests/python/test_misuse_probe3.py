# The third misuse probe (issue 20): amp.initialize all or nothing when a model's or an optimizer's
# own code raises partway (each stage: the cast, the forward patch, the optimizer's processing, the
# masters, O1's function patches), bit for bit; a model moved to another device after O2's masters
# were made.
from __future__ import annotations

import types

import pytest
import torch

from amp_support import amp_world, assert_same_world, make_model, one_cpu_thread  # noqa: F401  (autouse)
from conftest import random_tensor
from mixprec import amp
from mixprec.amp import _casts, _fp8
from mixprec.optimizers import FusedAdam, FusedSGD


class Refused(Exception):
    """What the hostile pieces below raise, so a test sees that very error come through."""


def batch(gen):
    return random_tensor((16, 8), torch.float32, "cpu", gen)


def scaled_step(model, opt, gen):
    opt.zero_grad()
    loss = model(batch(gen)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def everything(models, optimizers) -> dict:
    """amp_world plus what amp_world does not see: every module's class and instance attributes
    (forward patches, hooks), each optimizer's patched methods, the fp8 registry, O1's patches."""
    world = amp_world(models, optimizers)
    world["modules"] = [[(type(m), sorted(m.__dict__), len(m._state_dict_hooks), len(m._load_state_dict_post_hooks))
                         for m in model.modules()] for model in models]
    world["optimizer attrs"] = [sorted(o.__dict__) for o in optimizers]
    world["fp8"] = id(_fp8.REGISTRY.layers)
    world["registry"] = [(id(m), name, id(getattr(m, name))) for m, name, _ in _casts._registry]
    world["amp attrs"] = sorted((k, id(v)) for k, v in vars(amp._amp_state).items())
    return world


@pytest.fixture
def earlier(gen):
    """An amp.initialize in force before the refused call, which must stay in force."""
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaled_step(model, opt, gen)
    return model, opt


def trained(model, opt, gen) -> None:
    """The earlier initialize still trains: its step changes the weights (within a few steps: at
    O2's first scale, 2**16, a random batch's float16 gradients may overflow, and that step is
    skipped while the scale backs off)."""
    weights = [p.detach().clone() for p in model.parameters()]
    for _ in range(4):
        scaled_step(model, opt, gen)
        if any(not torch.equal(w, p) for w, p in zip(weights, model.parameters())):
            return
    raise AssertionError("four scaled steps left every weight as it was")


# -- the hostile pieces, one per stage ------------------------------------------------------------
class CastRefusingLinear(torch.nn.Linear):
    """A module whose own _apply casts its weight, then fails (an unsupported dtype, memory)."""

    def _apply(self, fn, recurse=True):
        self.weight.data = fn(self.weight)
        raise Refused("this module cannot be cast")


class UncastableParameter(torch.nn.Parameter):
    """A parameter that cannot become float16 (a tensor subclass whose ``to`` refuses the dtype)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and torch.float16 in (*args[1:], kwargs.get("dtype")):
            raise Refused("this parameter cannot be float16")
        return super().__torch_function__(func, types, args, kwargs)


class ForwardGuardedSequential(torch.nn.Sequential):
    """A model that refuses a new ``forward`` attribute (some wrappers guard their attributes)."""

    def __setattr__(self, name, value):
        if name == "forward":
            raise Refused("forward is read-only here")
        super().__setattr__(name, value)


class ArmedSGD(torch.optim.SGD):
    """state_dict() fails once armed: the recast of existing state (O2's swap, O3) fails."""
    armed = False

    def state_dict(self):
        if self.armed:
            raise Refused("state_dict failed")
        return super().state_dict()


class MasterRefusingAdam(FusedAdam):
    """Its per-param state (O2's masters) cannot be made past the second param."""
    armed = False

    def _init_param_state(self, p, group):
        if self.armed and len(self.state) >= 2:
            raise Refused("out of memory making the masters")
        super()._init_param_state(p, group)


def hostile_model(gen, last):
    model = make_model(gen, "cpu")
    layers = list(model)
    if last == "cast":
        bad = CastRefusingLinear(32, 4)
        bad.load_state_dict(layers[3].state_dict())
        layers[3] = bad
    seq = ForwardGuardedSequential(*layers) if last == "forward" else torch.nn.Sequential(*layers)
    if last == "param":
        seq[3].bias = UncastableParameter(seq[3].bias.detach().clone())
    return seq


def _with_grads(model, gen):
    model(batch(gen)).pow(2).mean().backward()  # grads too must come back as they were (dtype, values)


STAGES = {
    # stage: (opt_level, optimizer kind, model 2's failing piece)
    "model_cast": ("O2", "sgd", "cast"),
    "model_cast_fused": ("O2", "fused", "cast"),
    "param_cast": ("O3", "sgd", "param"),
    "forward_patch": ("O1", "sgd", "forward"),
    "forward_patch_o2": ("O2", "fused", "forward"),
    "optimizer_recast": ("O2", "armed_sgd", None),
    "o3_optimizer_recast": ("O3", "armed_sgd", None),
    "masters": ("O2", "master_refusing", None),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_initialize_that_fails_partway_changes_nothing(stage, earlier, gen):
    """Every model and optimizer of the call, amp's globals and the earlier initialize's objects are
    as they were, bit for bit: before, the models of a failed O2 call stayed cast to float16 (and
    patched), amp was left uninitialized, and the optimizers before the failing one stayed patched."""
    level, kind, piece = STAGES[stage]
    first = make_model(gen, "cpu")
    second = hostile_model(gen, piece)
    models = [first, second]
    if kind == "fused":
        opts = [FusedAdam(m.parameters(), lr=1e-3) for m in models]
    elif kind == "master_refusing":
        opts = [FusedAdam(first.parameters(), lr=1e-3), MasterRefusingAdam(second.parameters(), lr=1e-3)]
    else:
        cls = ArmedSGD if kind == "armed_sgd" else torch.optim.SGD
        opts = [cls(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for m, o in zip(models, opts):  # existing state (momentum), and grads left on the params
        _with_grads(m, gen)
        if not isinstance(o, MasterRefusingAdam):  # (its masters are made from empty state)
            o.step()
        _with_grads(m, gen)
    if kind == "master_refusing":  # masters already in the state (a checkpoint loaded before initialize)
        for p in first.parameters():
            opts[0].state[p]["master_param"] = random_tensor(p.shape, torch.float32, "cpu", gen)
    opts[1].armed = False  # (an instance attribute, there before and after)
    before = everything(models + [earlier[0]], opts + [earlier[1]])
    opts[1].armed = True
    with pytest.raises(Refused):
        amp.initialize(models, opts, opt_level=level, verbosity=0)
    opts[1].armed = False
    assert_same_world(before, everything(models + [earlier[0]], opts + [earlier[1]]))
    trained(*earlier, gen)
    # The same models and optimizers, the hostile piece fixed, initialize and train as ever.
    if piece == "cast":
        second[3].__class__ = torch.nn.Linear
    elif piece == "param":
        second[3].bias.__class__ = torch.nn.Parameter
    elif piece == "forward":
        second.__class__ = torch.nn.Sequential
    models, opts = amp.initialize(models, opts, opt_level=level, verbosity=0)
    for m, o in zip(models, opts):
        trained(m, o, gen)


def test_o1_function_patches_are_taken_back(earlier, gen):
    """The last stage: O1 re-applies the registered function patches; one that cannot be set fails
    the call, and the patches set before it come back out."""
    ns = types.SimpleNamespace(fine=lambda x: x * 2, touchy=lambda x: x + 1)
    amp.register_float_function(ns, "fine")
    amp.register_half_function(ns, "touchy")
    entries = _casts._registry[-2:]
    try:
        raw_fine, raw_touchy = ns.fine.__wrapped__, ns.touchy.__wrapped__

        class Guarded(types.SimpleNamespace):
            def __setattr__(self, name, value):
                if name == "touchy":
                    raise Refused("read-only")
                super().__setattr__(name, value)

        guarded = Guarded(touchy=raw_touchy)
        ns.fine = raw_fine  # as if unpatched since (amp.init's handle put back what it found)
        _casts._registry[-1] = (guarded, "touchy", "half")
        model = make_model(gen, "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = everything([model, earlier[0]], [opt, earlier[1]])
        with pytest.raises(Refused):
            amp.initialize(model, opt, opt_level="O1", verbosity=0)
        assert ns.fine is raw_fine  # was left patched before
        assert_same_world(before, everything([model, earlier[0]], [opt, earlier[1]]))
        trained(*earlier, gen)
    finally:
        for entry in entries:
            if entry in _casts._registry:
                _casts._registry.remove(entry)
        _casts._registry[:] = [e for e in _casts._registry if e[0] is not guarded]


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedSGD])
def test_a_failed_initialize_keeps_torch_future_flags(opt_cls, gen):
    """The overwrite-on-conversion flag amp turns off for the cast is back as it was."""
    model = hostile_model(gen, "cast")
    opt = opt_cls(model.parameters(), lr=0.1)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        before = everything([model], [opt])
        with pytest.raises(Refused):
            amp.initialize(model, opt, opt_level="O2", verbosity=0)
        assert torch.__future__.get_overwrite_module_params_on_conversion() is True
        assert_same_world(before, everything([model], [opt]))
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


# -- O2 with a torch optimizer: the stray-gradient guard, now one C-level pass, still sees every param ------
def _scale_in_place(g):
    g.mul_(2)  # a clip of one parameter's gradient


def _replace(g):
    return g.clone()  # a new tensor put in .grad


@pytest.mark.parametrize("change", [_scale_in_place, _replace], ids=["in_place", "replaced"])
@pytest.mark.parametrize("when", ["after_the_block", "after_a_step"])
def test_o2_guard_sees_a_change_to_any_one_params_gradient(change, when, gen):
    """The guard is no longer a Python loop over marks, but still covers every fp16 param: only the
    middle one (not the first or last, which a fused optimizer's cheaper watch covers) changes."""
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    loss = model(batch(gen)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    if when == "after_a_step":
        opt.step()
    middle = model[3].weight  # low params: 0.weight, 3.weight, 3.bias (BatchNorm stays fp32)
    new = change(middle.grad)
    if new is not None:
        middle.grad = new
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): the model's torch.float16 parameter of shape \(4, 32\) has "
                                           "a gradient amp did not unscale"):
        opt.step()
    assert_same_world(before, amp_world([model], [opt]))


# -- torch.compile after a dtype change ---------------------------------------------------------------
def _small(gen):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, scale=0.3))
    return model


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks_allowed", "fullgraph"])
@pytest.mark.parametrize("level,change", [("O1", "half"), ("O2", "float"), ("O3", "double")])
def test_a_compiled_forward_after_a_dtype_change_says_what_happened(level, change, fullgraph, gen, fresh_dynamo):
    """Compiled, an O2/O3 model recast after initialize gave torch's "mat1 and mat2 must have the same
    dtype" from fake tensors, before the eager path's except could name the change. (Under
    fullgraph=True dynamo reports the error as an exception it cannot trace, with mixprec's text.)"""
    model = amp.initialize(_small(gen), opt_level=level, verbosity=0, dtype=torch.bfloat16)
    x = batch(gen)
    torch.compile(model, backend="eager", fullgraph=fullgraph)(x)  # compiled before the change, too
    getattr(model, change)()
    now = next(model.parameters()).dtype
    then = torch.float32 if level == "O1" else torch.bfloat16
    with pytest.raises(Exception, match=rf"Sequential.forward: parameter '0.weight' is {now}, but amp.initialize "
                                        rf"left it {then}: the model's dtype was changed after amp.initialize") as info:
        torch.compile(model, backend="eager", fullgraph=fullgraph)(x)
    assert "mat1 and mat2" not in str(info.value)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_compiled_forward_is_one_graph_as_before(level, gen, fresh_dynamo):
    """The check runs only while dynamo traces, and folds away there: one graph, no break, only the
    model's own ops and amp's casts, and the eager result."""
    model = amp.initialize(_small(gen), opt_level=level, verbosity=0, dtype=torch.bfloat16)
    x = batch(gen)
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    calls = [str(getattr(n.target, "__name__", n.target)).split(".")[0] for n in explained.graphs[0].graph.nodes
             if n.op in ("call_function", "call_method", "call_module")]
    casts = ["_enter_autocast", "_exit_autocast", "to"] if level == "O1" else ["to", "to"]
    assert sorted(calls) == sorted(["linear", "relu", "linear"] + casts), calls
    assert torch.equal(torch.compile(model, backend="eager", fullgraph=True)(x), model(x))
