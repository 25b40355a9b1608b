# Misuse of mixprec.amp's entry points: every refused call (initialize, scale_loss, the loaders,
# the loss scalers' settable scale, master_params) raises an error naming the call and the
# argument and changes nothing, and the states amp knows of (an exception inside scale_loss,
# delay_unscale without a closing block, an empty optimizer list, a second GradScaler) can never
# apply still-scaled gradients.
from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_support import amp_world, assert_same_world, make_model, one_cpu_thread  # noqa: F401  (autouse)
from conftest import random_tensor
import mixprec.amp._process as amp_process
from mixprec import GradScaler, amp
from mixprec.amp import _amp_state
from mixprec.optimizers import FusedAdam, FusedSGD


@pytest.fixture(autouse=True)
def warn_again(monkeypatch):
    """amp warns once per process about a misplaced step; each test sees its own first time."""
    monkeypatch.setattr(amp_process, "_warned", set(), raising=False)


def o2_world(gen, kind="fused"):
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=1e-2) if kind == "fused" else torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    return model, opt


def train_step(model, opt, gen, poison=None, inside=False):
    opt.zero_grad()
    x = random_tensor((16, 8), torch.float32, "cpu", gen)
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if poison is not None:
            model[0].weight.grad.view(-1)[0] = poison
        if inside:
            opt.step()
    if not inside:
        opt.step()
    return loss.detach()


def scale_in_force(model, opt, gen) -> float:
    """The factor scale_loss applies now, checked against amp.loss_scale() read before the
    block (its backward may overflow in float16 and halve the scale on exit)."""
    loss = model(random_tensor((4, 8), torch.float32, "cpu", gen)).float().pow(2).mean()
    expected = amp.loss_scale()
    with amp.scale_loss(loss, opt) as scaled:
        factor = (scaled / loss.float()).item()
        scaled.backward()
    opt.zero_grad()
    assert factor == expected
    return factor


# -- 1. a refused initialize leaves the amp that is in force alone ------------------------------------
BAD_INITIALIZE = [
    (dict(opt_level="02"), RuntimeError, "letter O"),
    (dict(opt_level="O2", loss_scale="huge"), ValueError, "loss_scale"),
    (dict(opt_level="O2", loss_scale=math.nan), ValueError, "loss_scale"),
    (dict(opt_level="O2", verbosity="loud"), ValueError, "verbosity"),
    (dict(opt_level="O2", verbosity=1.5), ValueError, "verbosity"),
    (dict(opt_level="O2", verbosity=-1), ValueError, "verbosity"),
    (dict(opt_level="O2", num_losses=0), ValueError, "num_losses"),
    (dict(opt_level="O2", scale_history=-2), ValueError, "scale_history"),
    (dict(opt_level="O1", layer_kernels=True), ValueError, "layer_kernels"),
    (dict(opt_level="O2", min_loss_scale=4.0, max_loss_scale=2.0), ValueError, "max_loss_scale"),
    (dict(opt_level="O2", dtype=torch.float64), ValueError, "dtype"),
]


@pytest.mark.parametrize("kwargs, exc, match", BAD_INITIALIZE)
def test_refused_initialize_keeps_the_running_amp(kwargs, exc, match, gen):
    model, opt = o2_world(gen)
    train_step(model, opt, gen)
    other = make_model(gen, "cpu")
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    before = amp_world([model, other], [opt, other_opt])
    with pytest.raises(exc, match=match):
        amp.initialize(other, other_opt, **kwargs)
    assert_same_world(before, amp_world([model, other], [opt, other_opt]))
    # amp still scales and still skips overflowing steps for the model initialized before.
    assert scale_in_force(model, opt, gen) > 1
    params = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt, gen, poison=math.inf)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters())), "the overflowing step was applied"


@pytest.mark.parametrize("case", ["passed_before", "twice_in_list", "ddp_like", "not_a_model", "fp16_model"])
def test_refused_targets_change_nothing(case, gen):
    model, opt = o2_world(gen)
    other = make_model(gen, "cpu")
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    args = {"passed_before": (other, opt), "twice_in_list": (other, [other_opt, other_opt]),
            "ddp_like": (torch.nn.DataParallel(other), other_opt), "not_a_model": ("model", other_opt),
            "fp16_model": (other.half(), other_opt)}[case]
    before = amp_world([model, other], [opt, other_opt])
    with pytest.raises((RuntimeError, TypeError), match="once|Parallel|must be either|expected torch.float32"):
        amp.initialize(*args, opt_level="O2")
    assert_same_world(before, amp_world([model, other], [opt, other_opt]))


def test_allow_incoming_model_not_fp32(gen, monkeypatch):
    model = make_model(gen, "cpu").half()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="allow_incoming_model_not_fp32"):
        amp.initialize(model, opt, opt_level="O2")
    monkeypatch.setattr(_amp_state, "allow_incoming_model_not_fp32", True)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters = [opt.state[p]["master_param"] for p in model.parameters() if p.dtype == torch.float16]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    for p, m in zip([p for p in model.parameters() if p.dtype == torch.float16], masters):
        assert torch.equal(m, p.float())  # the masters start from the incoming half values
    before = [m.clone() for m in masters]
    train_step(model, opt, gen)
    assert any(not torch.equal(a, b) for a, b in zip(before, masters))


# -- 4. Apex's state objects ------------------------------------------------------------------------
def test_loss_scaler_scale_is_settable_and_checked(gen):
    model, opt = o2_world(gen)
    train_step(model, opt, gen)
    scaler = _amp_state.loss_scalers[0]
    # 2**15 when this seed's first fp16 step overflowed at the starting 2**16 (rightly skipped).
    assert scaler._loss_scale == amp.loss_scale() and amp.loss_scale() in (2.0**16, 2.0**15)
    scaler._loss_scale = 128.0
    assert scale_in_force(model, opt, gen) == 128.0
    assert _amp_state.opt_properties.opt_level == "O2" and _amp_state.opt_properties.master_weights
    for bad in (math.nan, math.inf, 0.0, -2.0, 1e-300, 1e39, "x", True, torch.tensor([1.0, 2.0])):
        before = amp_world([model], [opt])
        with pytest.raises(ValueError, match="_loss_scale must be a finite number >= "):
            scaler._loss_scale = bad
        assert_same_world(before, amp_world([model], [opt]))


# -- 6. loaders validate everything, then write -----------------------------------------------------
def good_amp_state(model, opt, gen) -> dict:
    train_step(model, opt, gen)
    return amp.state_dict()


@pytest.mark.parametrize("corrupt", [
    lambda s: s["loss_scaler0"].update(unskipped=2**40),
    lambda s: s["loss_scaler0"].update(unskipped=-1),
    lambda s: s["loss_scaler0"].update(loss_scale=math.nan),
    lambda s: s["loss_scaler0"].update(loss_scale=0.0),
    lambda s: s["loss_scaler0"].update(loss_scale="65536"),
    lambda s: s["loss_scaler0"].pop("unskipped"),
    lambda s: s.update(loss_scaler1=dict(s["loss_scaler0"])),
    lambda s: s.update(extra=1),
])
def test_amp_load_state_dict_refuses_and_changes_nothing(corrupt, gen):
    model, opt = o2_world(gen)
    state = good_amp_state(model, opt, gen)
    _amp_state.loss_scalers[0]._loss_scale = 512.0
    corrupt(state)
    before = amp_world([model], [opt])
    with pytest.raises((ValueError, RuntimeError), match="loss_scaler|Unexpected key|num_losses"):
        amp.load_state_dict(state)
    assert_same_world(before, amp_world([model], [opt]))


class WithExtraState(torch.nn.Module):
    """A module whose set_extra_state refuses bad values: a loader check the validation cannot see."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.tag = 1

    def forward(self, x):
        return self.inner(x)

    def get_extra_state(self):
        return {"tag": self.tag}

    def set_extra_state(self, state):
        if not isinstance(state, dict) or not isinstance(state.get("tag"), int):
            raise ValueError("WithExtraState: bad extra state")
        self.tag = state["tag"]


@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_load_checkpoint_state_is_all_or_nothing(kind, gen):
    inner = make_model(gen, "cpu")
    model = WithExtraState(inner)
    opt = FusedAdam(model.parameters(), lr=1e-2) if kind == "fused" else torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(random_tensor((16, 8), torch.float32, "cpu", gen)).pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save(amp.checkpoint_state(model, opt), buffer)
    for _ in range(2):  # move on, so that a load would change everything
        opt.zero_grad()
        with amp.scale_loss(model(random_tensor((16, 8), torch.float32, "cpu", gen)).pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    ckpt["models"][0]["_extra_state"] = {"tag": "not an int"}  # fails in the model's loader, after the optimizer's
    before = amp_world([model], [opt])
    with pytest.raises(ValueError, match="bad extra state"):
        amp.load_checkpoint_state(ckpt, model, opt)
    assert_same_world(before, amp_world([model], [opt]))


def test_truncated_checkpoint_says_what_it_is(gen, tmp_path):
    model, opt = o2_world(gen)
    train_step(model, opt, gen)
    buffer = io.BytesIO()
    torch.save(amp.checkpoint_state(model, opt), buffer)
    data = buffer.getvalue()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    before = amp_world([model], [opt])
    for source in (io.BytesIO(data[: len(data) // 2]), str(tmp_path / "cut.pt")):
        with pytest.raises(ValueError, match="amp.load_checkpoint_state: checkpoint .* could not be read"):
            amp.load_checkpoint_state(source, model, opt)
    assert_same_world(before, amp_world([model], [opt]))
    amp.load_checkpoint_state(io.BytesIO(data), model, opt)  # the whole file loads from a buffer too


# -- 7. scaled gradients never reach a step -----------------------------------------------------------
def twin_worlds(gen, kind):
    """Two identical O2 worlds (model, optimizer) and a shared stream of batches."""
    from amp_support import fresh
    base = make_model(gen, "cpu")
    worlds = []
    for _ in range(2):
        model = fresh(base)
        opt = (FusedAdam(model.parameters(), lr=1e-2) if kind == "fused"
               else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        worlds.append((model, opt))
    return worlds


def loss_of(model, x):
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize("kind", ["fused", "torch"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_exception_inside_scale_loss_drops_the_scaled_gradients(kind, level, gen):
    (m_a, o_a), (m_b, o_b) = twin_worlds(gen, kind)
    m_a, o_a = amp.initialize(m_a, o_a, opt_level=level, verbosity=0)
    xs = [random_tensor((16, 8), torch.float32, "cpu", gen) for _ in range(3)]
    # World a: a block whose code raises after backward, caught; then an ordinary step.
    for i, x in enumerate(xs):
        o_a.zero_grad()
        if i == 1:
            with pytest.raises(KeyError):
                with amp.scale_loss(loss_of(m_a, x), o_a) as s:
                    s.backward()
                    raise KeyError("user code")
            o_a.step()  # the grads of the failed block are gone: nothing to apply
        with amp.scale_loss(loss_of(m_a, x), o_a) as s:
            s.backward()
        o_a.step()
    # World b, the same without the failed block.
    amp_b = amp.initialize(m_b, o_b, opt_level=level, verbosity=0)
    m_b, o_b = amp_b
    for x in xs:
        o_b.zero_grad()
        with amp.scale_loss(loss_of(m_b, x), o_b) as s:
            s.backward()
        o_b.step()
    for a, b in zip(m_a.parameters(), m_b.parameters()):
        assert torch.equal(a, b)


def test_exception_after_delayed_blocks_refuses_the_step_until_zero_grad(gen):
    model, opt = o2_world(gen)
    x = random_tensor((16, 8), torch.float32, "cpu", gen)
    opt.zero_grad()
    with amp.scale_loss(loss_of(model, x), opt, delay_unscale=True) as s:
        s.backward()
    with pytest.raises(KeyError):
        with amp.scale_loss(loss_of(model, x), opt) as s:
            s.backward()
            raise KeyError("user code")
    loss = loss_of(model, x)  # (its forward updates BatchNorm's running stats)
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()
    with pytest.raises(RuntimeError, match="zero_grad"):
        with amp.scale_loss(loss, opt) as s:
            s.backward()
    assert_same_world(before, amp_world([model], [opt]))
    params = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt, gen)  # zero_grad first: training goes on
    assert any(not torch.equal(a, b) for a, b in zip(params, model.parameters()))


@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_delay_unscale_on_every_micro_batch_is_unscaled_at_the_step(kind, gen):
    (m_a, o_a), (m_b, o_b) = twin_worlds(gen, kind)
    xs = [random_tensor((16, 8), torch.float32, "cpu", gen) for _ in range(3)]
    m_a, o_a = amp.initialize(m_a, o_a, opt_level="O2", verbosity=0)
    o_a.zero_grad()
    for x in xs:
        with amp.scale_loss(loss_of(m_a, x), o_a, delay_unscale=True) as s:
            s.backward()
    with pytest.warns(UserWarning, match="delay_unscale=False on the last micro-batch"):
        o_a.step()
    m_b, o_b = amp.initialize(m_b, o_b, opt_level="O2", verbosity=0)
    o_b.zero_grad()
    for i, x in enumerate(xs):
        with amp.scale_loss(loss_of(m_b, x), o_b, delay_unscale=i < len(xs) - 1) as s:
            s.backward()
    o_b.step()
    for a, b in zip(m_a.parameters(), m_b.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizers, exc, match", [
    ([], ValueError, "optimizers is empty"),
    ((), ValueError, "optimizers is empty"),
    (None, TypeError, "optimizers must be an optimizer"),
    ("opt", TypeError, "optimizers must be an optimizer"),
])
def test_scale_loss_refuses_missing_optimizers_before_scaling(optimizers, exc, match, gen):
    model, opt = o2_world(gen)
    loss = loss_of(model, random_tensor((16, 8), torch.float32, "cpu", gen))
    before = amp_world([model], [opt])
    with pytest.raises(exc, match=match):
        with amp.scale_loss(loss, optimizers) as s:
            s.backward()
    assert_same_world(before, amp_world([model], [opt]))


def test_scale_loss_refuses_a_python_number(gen):
    model, opt = o2_world(gen)
    with pytest.raises(TypeError, match="loss must be the tensor"):
        with amp.scale_loss(1.5, opt):
            pass


@pytest.mark.parametrize("scaler_kind", ["torch", "mixprec"])
def test_amp_and_a_grad_scaler_together_are_refused(scaler_kind, gen):
    model, opt = o2_world(gen)
    scaler = torch.amp.GradScaler("cpu") if scaler_kind == "torch" else GradScaler("cpu")
    opt.zero_grad()
    with amp.scale_loss(scaler.scale(loss_of(model, random_tensor((16, 8), torch.float32, "cpu", gen))), opt) as s:
        s.backward()
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match="not both"):
        scaler.step(opt)
    world = amp_world([model], [opt])
    world["optimizers"][0] = world["optimizers"][0][:1] + before["optimizers"][0][1:]  # the block was completed
    assert_same_world(before["models"], world["models"])
    assert_same_world(before["optimizers"][0][0], world["optimizers"][0][0])


def test_master_params_of_a_model_says_what_to_pass(gen):
    model, opt = o2_world(gen)
    with pytest.raises(TypeError, match="amp.master_params: optimizer must be"):
        amp.master_params(model)


# -- property-based: random amp.load_state_dict corruptions --------------------------------------------
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                   st.text(max_size=3), st.lists(st.integers(), max_size=2))


@given(key=st.sampled_from(["loss_scale", "unskipped", "hysteresis", "_hysteresis_tracker", "_skipped_steps",
                            "min_scale", "max_scale"]), value=VALUES)
def test_random_scaler_state_either_loads_or_changes_nothing(key, value):
    gen = torch.Generator().manual_seed(0)
    model, opt = o2_world(gen)
    state = good_amp_state(model, opt, gen)
    state["loss_scaler0"][key] = value
    before = amp_world([model], [opt])
    try:
        amp.load_state_dict(state)
    except (ValueError, RuntimeError) as err:
        assert "loss_scaler0" in str(err)
        assert_same_world(before, amp_world([model], [opt]))
        return
    # Loaded: the values are what was given, and training still works.
    if key == "loss_scale":  # held in a float32 tensor
        assert amp.loss_scale() == torch.tensor(float(value), dtype=torch.float32).item()
    train_step(model, opt, gen)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_amp_state_handle_is_set_as_apex_code_expects(gen):
    from mixprec.amp._o1_handle import InitializeHandle, NoOpHandle
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    handle = _amp_state.handle
    assert isinstance(handle, InitializeHandle) and handle.is_active()
    loss = model(random_tensor((16, 8), torch.float32, "cpu", gen)).float().pow(2).mean()
    with handle.scale_loss(loss, opt) as scaled:  # Apex code reaches scale_loss through the handle
        assert (scaled / loss).item() == amp.loss_scale()
        scaled.backward()
    opt.step()
    amp.initialize(make_model(gen, "cpu"), enabled=False)
    assert isinstance(_amp_state.handle, NoOpHandle) and not _amp_state.handle.is_active()


@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_master_params_between_delayed_blocks_changes_nothing(kind, gen):
    # Reading the masters completes the delayed chain early (its gradients must be unscaled to be
    # read); the blocks after it must then not add scaled gradients onto the unscaled ones.
    (m_a, o_a), (m_b, o_b) = twin_worlds(gen, kind)
    xs = [random_tensor((16, 8), torch.float32, "cpu", gen) for _ in range(3)]
    grads: list[list[torch.Tensor]] = []
    for peek, (model, opt) in zip((True, False), ((m_a, o_a), (m_b, o_b))):
        # amp's scalers are global: one world at a time. A small static scale, so that neither
        # world overflows (where float16 sums overflow depends on the order they are taken in).
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
        opt.zero_grad()
        for i, x in enumerate(xs):
            with amp.scale_loss(loss_of(model, x), opt, delay_unscale=i < len(xs) - 1) as s:
                s.backward()
            if peek and i == 0:
                list(amp.master_params(opt))
        # The gradients the step will apply (reading the masters completes world b's chain too).
        grads.append([p.grad.detach().clone() for p in amp.master_params(opt)])
        opt.step()
    # The same sums, rounded in other orders (float16 model grads, float32 master grads); scaled
    # gradients added onto unscaled ones would be 128x off. The grads, not the weights, are
    # compared: Adam's update of a near-zero gradient is +-lr whatever its size, so a rounding
    # that flips such a gradient's sign moves a weight by 2 lr (seed 88).
    for i, (a, b) in enumerate(zip(*grads)):
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-3 * b.abs().max().item()), f"master grad {i}"


@pytest.mark.parametrize("level, kind", [("O2", "fused"), ("O2", "torch"), ("O1", "torch")])
@pytest.mark.parametrize("call", ["step", "unscale_"])
def test_a_grad_scaler_alone_on_an_amp_optimizer_is_refused(level, kind, call, gen):
    # The loss went through the GradScaler only: at O1 amp would apply the GradScaler-scaled
    # gradients (unscaled by nothing of amp's); at O2 the masters have no gradients at all (the
    # scaler found "no inf checks"). Refused with what to do, before anything changes.
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=1e-2) if kind == "fused" else torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    train_step(model, opt, gen)  # a real step first: optimizer state exists
    scaler = GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(loss_of(model, random_tensor((16, 8), torch.float32, "cpu", gen))).backward()
    before, scale = amp_world([model], [opt]), scaler._scale.clone()
    with pytest.raises(RuntimeError, match=rf"GradScaler\.{call}: .*amp.initialize.*not both"):
        getattr(scaler, call)(opt)
    assert_same_world(before, amp_world([model], [opt]))
    assert torch.equal(scaler._scale, scale) and id(opt) not in scaler._per_optimizer_states


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_sparse_gradient_is_refused_and_never_stepped(level, gen):
    # Before: O1 raised torch's NotImplementedError and O2 a memory-format error from the middle of
    # the unscale, the gradients stayed scaled, and the next step() wrote NaN into the weights.
    class SparseNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8, sparse=True)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, idx):
            return self.head(self.embed(idx))

    torch.manual_seed(0)
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    before = amp_world([model], [opt])
    loss = model(torch.tensor([[1, 2, 3]])).float().sum()
    with pytest.raises(RuntimeError, match="amp.scale_loss: a parameter has a sparse gradient"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()  # nothing to apply: the block's gradients were dropped
    assert_same_world(before, amp_world([model], [opt]))


@pytest.mark.parametrize("kind", ["fused", "torch"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_failed_second_block_keeps_the_first_blocks_gradients(kind, level, gen):
    # Before: at O2 with a torch optimizer the failed block's clean-up set every master's grad to
    # None, so block 1's gradient was lost and the step silently did nothing.
    (m_a, o_a), (m_b, o_b) = twin_worlds(gen, kind)
    m_a, o_a = amp.initialize(m_a, o_a, opt_level=level, verbosity=0, loss_scale=128.0)
    m_b, o_b = amp.initialize(m_b, o_b, opt_level=level, verbosity=0, loss_scale=128.0)
    xs = [random_tensor((16, 8), torch.float32, "cpu", gen) for _ in range(2)]
    initial = [p.detach().clone() for p in m_a.parameters()]
    for model, opt, fail in ((m_a, o_a, True), (m_b, o_b, False)):
        for x in xs:
            opt.zero_grad()
            with amp.scale_loss(loss_of(model, x), opt) as s:
                s.backward()
            if fail:
                with pytest.raises(KeyError):
                    with amp.scale_loss(loss_of(model, x), opt) as s:
                        s.backward()
                        raise KeyError("user code")
            opt.step()
    for a, b in zip(m_a.parameters(), m_b.parameters()):
        assert torch.equal(a, b)
    assert all(not torch.equal(a, b) for a, b in zip(m_a.parameters(), initial))  # the steps did train


@pytest.mark.parametrize("kind", ["fused", "torch"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_backward_after_the_block_ended_is_never_stepped(kind, level, gen):
    # Apex's silent case (the tutorial's indentation slip): the block ends before the backward, so
    # nothing unscales the gradients it makes. Before: O1 applied them scaled by 2**16.
    (model, opt), _ = twin_worlds(gen, kind)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    train_step(model, opt, gen)
    opt.zero_grad()
    with amp.scale_loss(loss_of(model, random_tensor((16, 8), torch.float32, "cpu", gen)), opt) as scaled:
        pass
    scaled.backward()
    next_loss = loss_of(model, random_tensor((16, 8), torch.float32, "cpu", gen))  # (its forward moves BatchNorm)
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match=r"step\(\): the scaled loss .* backpropagated after the block ended"):
        opt.step()
    with pytest.raises(RuntimeError, match="amp.scale_loss: the scaled loss"):
        with amp.scale_loss(next_loss, opt):
            pass
    assert_same_world(before, amp_world([model], [opt]))
    opt.zero_grad()  # clears it: training goes on
    train_step(model, opt, gen)


@pytest.mark.parametrize("scale, bound", [(2.0**30, "max_scale"), (0.5, "min_scale")])
def test_a_loaded_scale_outside_the_scalers_bounds_is_refused(scale, bound, gen):
    # Before: 2**30 above max_loss_scale (2**24) was taken, and fp16 steps were skipped until the
    # scale came back down; mixprec.GradScaler.load_state_dict refuses the same.
    model = make_model(gen, "cpu")
    model, opt = amp.initialize(model, FusedAdam(model.parameters(), lr=1e-2), opt_level="O2", verbosity=0,
                                min_loss_scale=1.0)
    train_step(model, opt, gen)
    sd = amp.state_dict()
    sd["loss_scaler0"] = dict(sd["loss_scaler0"], loss_scale=scale)
    sd["loss_scaler0"].pop("min_scale", None)
    sd["loss_scaler0"].pop("max_scale", None)
    before = amp_world([model], [opt])
    with pytest.raises(ValueError, match=rf"\['loss_scale'\] must be [<>]= {bound}"):
        amp.load_state_dict(sd)
    assert_same_world(before, amp_world([model], [opt]))


def test_checkpoint_calls_with_swapped_arguments_name_them(gen):
    model, opt = o2_world(gen)
    cs = amp.checkpoint_state(model, opt)
    before = amp_world([model], [opt])
    with pytest.raises(TypeError, match=r"amp.load_checkpoint_state: models must be a torch.nn.*Module or a list"):
        amp.load_checkpoint_state(cs, opt, model)
    with pytest.raises(TypeError, match=r"amp.checkpoint_state: optimizers must be a torch.optim.*Optimizer"):
        amp.checkpoint_state(model, model)
    assert_same_world(before, amp_world([model], [opt]))


def test_a_low_precision_model_is_named_by_index(gen):
    fp32, half = make_model(gen, "cpu"), make_model(gen, "cpu").half()
    opt = FusedAdam(list(fp32.parameters()) + list(half.parameters()), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"(?s)expected torch.float32 \(amp.initialize: models\[1\]\).*pass each model once"):
        amp.initialize([fp32, half], opt, opt_level="O2", verbosity=0)


def test_a_sparse_master_in_a_checkpoint_is_refused_by_name(gen):
    # Before: it passed validation and failed in the copy ("copy_() between dense and sparse").
    model = make_model(gen, "cpu")
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    train_step(model, opt, gen)
    cs = amp.checkpoint_state(model, opt)
    cs["masters"][0][0] = cs["masters"][0][0].to_sparse()
    before = amp_world([model], [opt])
    with pytest.raises(ValueError, match=r"checkpoint\['masters'\]\[0\]\[0\] must be a dense float32 tensor"):
        amp.load_checkpoint_state(cs, model, opt)
    assert_same_world(before, amp_world([model], [opt]))
