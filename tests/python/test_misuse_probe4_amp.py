# The fourth misuse probe (issue 20), part 3: mixprec.GradScaler (disabled paths, odd outputs and
# new scales, checkpoints with wrong types, mid-iteration calls) beside torch.amp.GradScaler, and
# amp (initialize arguments, loss ids, state dicts, nested blocks, O1's cast cache).
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from amp_support import amp_world, assert_same_world, make_model, one_cpu_thread  # noqa: F401  (autouse)
from conftest import assert_bitwise_equal, random_tensor, rel_err
from mixprec import GradScaler, amp
from mixprec.optimizers import FusedAdam, FusedSGD
from test_misuse_probe4 import refused


def scaled_setup(gen, fused=True):
    """Two params with gradients already scaled by 4, an optimizer, and a scaler at scale 4 that
    has scaled a loss (this iteration's stage: 'scaled')."""
    ps = [torch.nn.Parameter(random_tensor(s, torch.float32, "cpu", gen)) for s in ((5, 3), (4,))]
    for p in ps:
        p.grad = 4.0 * random_tensor(p.shape, torch.float32, "cpu", gen)
    opt = FusedAdam(ps, lr=0.1) if fused else torch.optim.SGD(ps, lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    return ps, opt, scaler


def scaler_world(s: GradScaler) -> list:
    return [s.state_dict(), sorted((k, str(v["stage"]), sorted(map(str, v["found_inf_per_device"])))
                                   for k, v in s._per_optimizer_states.items())]


# ---- GradScaler ----------------------------------------------------------------------------

def test_a_disabled_scaler_passes_everything_through_as_torchs(gen):
    ps, opt, _ = scaled_setup(gen)
    ours, theirs = GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", enabled=False)
    for s in (ours, theirs):
        s.load_state_dict(GradScaler("cpu").state_dict())  # ignored, as torch ignores it
        assert s.get_scale() == 1.0 and s.state_dict() == {} and s.scale("x") == "x"
    w = [p.detach().clone() for p in ps]
    ours.unscale_(opt)
    ours.step(opt)
    ours.update()
    assert not any(torch.equal(a, p) for a, p in zip(w, ps))  # stepped with the grads as they were


def test_an_empty_checkpoint_into_an_enabled_scaler_says_where_it_came_from():
    s = GradScaler("cpu")
    refused(lambda: s.load_state_dict({}), [scaler_world(s)], RuntimeError, "source state dict is empty")
    assert s.state_dict() == GradScaler("cpu").state_dict()


@pytest.mark.parametrize("outputs", [torch.tensor(3), torch.tensor(60000.0, dtype=torch.float16),
                                     [torch.ones(1), [torch.ones(2)]]], ids=["int", "fp16_0dim", "nested"])
def test_scale_of_odd_outputs_matches_torch(outputs):
    ours, theirs = GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)

    def flat(x):
        return [y for v in x for y in flat(v)] if isinstance(x, (list, tuple)) else [x]

    for a, b in zip(flat(ours.scale(outputs)), flat(theirs.scale(outputs))):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("new_scale", [torch.tensor([8.0]), torch.tensor([[8.0]])], ids=["[1]", "[1,1]"])
def test_update_with_a_non_0_dim_tensor_is_refused_as_torch_refuses_it(new_scale, gen):
    """torch's own update fails too (its copy_ into the 0-dim scale cannot broadcast); mixprec says
    so by name, before anything changes."""
    ps, opt, s = scaled_setup(gen)
    s.step(opt)
    refused(lambda: s.update(new_scale), [scaler_world(s)], AssertionError,
            "GradScaler.update: new_scale must be .* 0-dim tensor")
    t = torch.amp.GradScaler("cpu", init_scale=4.0)
    t.scale(torch.ones(()))
    t.step(torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(RuntimeError):
        t.update(new_scale)


@pytest.mark.parametrize("new_scale", [torch.tensor(8), torch.tensor(8.0, dtype=torch.float64)], ids=["int", "float64"])
def test_update_takes_a_0_dim_tensor_of_any_real_dtype_as_torch(new_scale, gen):
    ps, opt, s = scaled_setup(gen)
    s.step(opt)
    s.update(new_scale)
    assert s.get_scale() == 8.0


BAD_STATE = [("scale", "4.0"), ("growth_interval", 2.5), ("_growth_tracker", -1), ("hysteresis", 0),
             ("min_scale", float("nan")), ("_skipped_steps", -3), ("max_scale", 1.0)]


@pytest.mark.parametrize("key, value", BAD_STATE, ids=lambda v: repr(v)[:20])
def test_a_checkpoint_value_of_the_wrong_type_or_range_is_refused_by_key(key, value):
    s = GradScaler("cpu")
    sd = dict(s.state_dict(), **{key: value})
    name = "state_dict: scale must be <= max_scale" if key == "max_scale" else rf"state_dict\['{key}'\]"
    refused(lambda: s.load_state_dict(sd), [scaler_world(s)], ValueError, "GradScaler.load_state_dict: " + name)


def test_a_checkpoint_with_tensor_values_loads_and_round_trips_weights_only():
    s = GradScaler("cpu", hysteresis=2, min_scale=1.0, history_size=4)
    sd = dict(s.state_dict(), scale=torch.tensor(8.0), growth_factor=torch.tensor(4.0))
    s.load_state_dict(sd)
    assert s.get_scale() == 8.0 and s.get_growth_factor() == 4.0
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    t = GradScaler("cpu", hysteresis=2, min_scale=1.0, history_size=4)
    t.load_state_dict(torch.load(buf, weights_only=True))
    assert t.state_dict() == s.state_dict()


def test_pickling_mid_iteration_is_refused_as_torch_refuses_it(gen):
    ps, opt, s = scaled_setup(gen)
    s.unscale_(opt)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning of an iteration"):
        pickle.dumps(s)
    s.step(opt)
    s.update()
    assert pickle.loads(pickle.dumps(s)).state_dict() == s.state_dict()


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_without_gradients_fails_as_torchs(fused, gen):
    # PEER-SAME: torch.amp.GradScaler asserts at step (plain) or at update (fused) alike.
    ps, opt, s = scaled_setup(gen, fused)
    t = torch.amp.GradScaler("cpu", init_scale=4.0)
    t.scale(torch.ones(()))
    for p in ps:
        p.grad = None
    for scaler in (s, t):
        if fused:
            scaler.step(opt)
            with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
                scaler.update()
        else:
            with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
                scaler.step(opt)


def test_a_step_refused_by_the_optimizer_can_be_retried(gen):
    ps, opt, s = scaled_setup(gen, fused=False)
    g, w = [p.grad / 4.0 for p in ps], [p.detach().clone() for p in ps]
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        s.step(opt, foo=1)  # as torch's: the grads are unscaled by then, and stay so
    s.step(opt)
    s.update()
    for p, a, b in zip(ps, w, g):
        torch.testing.assert_close(p.detach(), a - 0.1 * b, rtol=1e-6, atol=1e-7)


def test_an_inf_gradient_of_a_plain_optimizer_is_skipped(gen):
    ps, opt, s = scaled_setup(gen, fused=False)
    ps[0].grad[0, 0] = float("inf")
    w = [p.detach().clone() for p in ps]
    s.step(opt)
    s.update()
    for a, p in zip(w, ps):
        assert_bitwise_equal(p.detach(), a)
    assert s.get_scale() == 2.0


def test_bf16_gradients_unscale_in_place(gen):
    ps, opt, s = scaled_setup(gen, fused=False)
    for p in ps:
        p.data, p.grad = p.data.bfloat16(), p.grad.bfloat16()
    g = [p.grad.clone() for p in ps]
    s.unscale_(opt)
    for p, a in zip(ps, g):
        assert_bitwise_equal(p.grad, a / 4.0)


# ---- amp ------------------------------------------------------------------------------------

def o2(gen, num_losses=2):
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level="O2", num_losses=num_losses, verbosity=0)


def batch(gen):
    return random_tensor((16, 8), torch.float32, "cpu", gen)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(num_losses=0), ValueError, "num_losses must be a positive int, got 0"),
    (dict(num_losses=1.5), ValueError, "num_losses must be a positive int, got 1.5"),
    (dict(num_losses=True), ValueError, "num_losses must be a positive int, got True"),
    (dict(opt_level="O5"), RuntimeError, "Unexpected optimization level O5"),
    (dict(opt_level=2), RuntimeError, "Unexpected optimization level 2"),
    (dict(dtype=torch.float64), ValueError, "dtype must be torch.float16 or torch.bfloat16"),
    (dict(loss_scale=-1.0), ValueError, "loss_scale must be a finite number"),
    (dict(loss_scale="dyn"), ValueError, "loss_scale must be 'dynamic' or a number"),
    (dict(loss_scale=float("inf")), ValueError, "loss_scale must be a finite number"),
    (dict(cast_model_type=torch.float64), ValueError, "cast_model_type must be None"),
    (dict(min_loss_scale=2.0**20, max_loss_scale=2.0**10), ValueError, r"max_loss_scale \(1024.0\) < min_loss_scale"),
    (dict(opt_level="O1", keep_batchnorm_fp32=False), RuntimeError, "keep_batchnorm_fp32 should be None"),
    (dict(opt_level="O1", master_weights=True), RuntimeError, "doesn't make sense to use master_weights with O1"),
], ids=lambda v: repr(v)[:40])
def test_initialize_refuses_and_keeps_the_running_amp(kwargs, exc, pattern, gen):
    model, opt = o2(gen)
    other, other_opt = make_model(gen, "cpu"), None
    kwargs = dict(dict(opt_level="O2"), **kwargs)
    if kwargs["opt_level"] == "O1":
        other_opt = FusedAdam(other.parameters())
    before = amp_world([model], [opt])
    with pytest.raises(exc, match=pattern):
        amp.initialize(other, other_opt, **kwargs)
    assert_same_world(before, amp_world([model], [opt]))


@pytest.mark.parametrize("loss_id", [2, -1, True, 1.0, "0"], ids=repr)
def test_a_bad_loss_id_names_the_call(loss_id, gen):
    model, opt = o2(gen)
    loss = model(batch(gen)).float().sum()
    before = amp_world([model], [opt])
    with pytest.raises(ValueError, match=r"amp.scale_loss: loss_id must be an int in \[0, num_losses=2\)"):
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            scaled.backward()
    assert_same_world(before, amp_world([model], [opt]))
    for call in (amp.loss_scale, amp.skipped_steps, amp.scale_history):
        with pytest.raises(ValueError, match=rf"amp.{call.__name__}: loss_id must be"):
            call(loss_id)


def test_state_dict_into_a_destination_that_is_no_dict_is_refused_by_name(gen):
    o2(gen)
    with pytest.raises(TypeError, match="amp.state_dict: destination must be a dict"):
        amp.state_dict(destination=[])
    dest = {"mine": 1}
    assert amp.state_dict(destination=dest) is dest and {"mine", "loss_scaler0", "loss_scaler1"} <= set(dest)


@pytest.mark.parametrize("change, exc, pattern", [
    (lambda d: dict(d, loss_scaler2=d["loss_scaler0"]), ValueError, "holds 3 loss scalers but .*num_losses=2"),
    (lambda d: {"loss_scaler1": d["loss_scaler1"]}, ValueError, "holds 1 loss scalers"),
    (lambda d: dict(d, other=1), RuntimeError, r"Unexpected key\(s\) in state_dict: \"other\". \(amp.load_state_dict"),
    (lambda d: dict(d, loss_scaler0=dict(d["loss_scaler0"], unskipped=True)), ValueError, r"\['unskipped'\]"),
    (lambda d: dict(d, loss_scaler0=dict(d["loss_scaler0"], unskipped=2.0)), ValueError, r"\['unskipped'\]"),
], ids=["extra_scaler", "missing_scaler", "unknown_key", "unskipped_bool", "unskipped_float"])
def test_a_bad_amp_state_dict_is_refused_by_name(change, exc, pattern, gen):
    model, opt = o2(gen)
    sd = change(amp.state_dict())
    before = amp_world([model], [opt])
    with pytest.raises(exc, match=pattern):
        amp.load_state_dict(sd)
    assert_same_world(before, amp_world([model], [opt]))


def test_amp_checkpoints_load_weights_only_and_refuse_another_models_shape(gen):
    model, opt = o2(gen)
    amp.load_state_dict(dict(amp.state_dict(), loss_scaler0=dict(amp.state_dict()["loss_scaler0"],
                                                                   loss_scale=torch.tensor(8.0))))
    assert amp.loss_scale(0) == 8.0
    buf = io.BytesIO()
    torch.save(amp.checkpoint_state(model, opt), buf)
    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=True)
    amp.load_checkpoint_state(checkpoint, model, opt)
    other = torch.nn.Sequential(torch.nn.Linear(8, 32, bias=False), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 5))
    other_opt = FusedAdam(other.parameters())
    before = amp_world([model, other], [opt, other_opt])
    with pytest.raises(ValueError, match=r"checkpoint\['models'\]\[0\]\['3.weight'\] has shape \(4, 32\) but the model's"):
        amp.load_checkpoint_state(checkpoint, other, other_opt)
    assert_same_world(before, amp_world([model, other], [opt, other_opt]))


def test_master_params_of_an_optimizer_amp_never_saw_are_its_params(gen):
    o2(gen)
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters())
    assert [id(p) for p in amp.master_params(opt)] == [id(p) for p in model.parameters()]
    with pytest.raises(TypeError, match="amp.master_params: optimizer must be a torch.optim.Optimizer"):
        list(amp.master_params([opt]))


@pytest.mark.parametrize("opt_cls", [FusedAdam, torch.optim.SGD])
def test_a_block_nested_in_another_over_one_optimizer_is_refused(opt_cls, gen):
    """The outer block's exit took the inner block's gradients, already unscaled into the masters,
    for its own and counted them again (torch.optim.SGD under O2: 2 * inner + outer). Refused
    now; the outer block goes on and gives its own loss's gradients."""
    model0 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(model0)
    opt = opt_cls(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = batch(gen)
    with amp.scale_loss(model(x).float().sum(), opt) as outer:
        loss = 2.0 * model(x).float().sum()
        before = amp_world([model], [opt])
        with pytest.raises(RuntimeError, match=r"amp.scale_loss: optimizers\[0\] .* is in an open `with amp.scale_loss` "
                                               "block already"):
            with amp.scale_loss(loss, opt) as inner:
                inner.backward()
        assert_same_world(before, amp_world([model], [opt]))
        outer.backward()
    model0(x).sum().backward()
    for master, ref in zip(amp.master_params(opt), model0.parameters()):
        assert rel_err(master.grad, ref.grad) < 5e-2  # an fp16 forward against an fp32 one


@pytest.mark.parametrize("make_loss, exc, pattern", [
    (lambda m, x: [m(x).float().sum()], TypeError, "amp.scale_loss: loss must be the tensor"),
    (lambda m, x: m(x).float()[0, :2], RuntimeError, "grad can be implicitly created only for scalar outputs"),
    (lambda m, x: torch.tensor(1.0), RuntimeError, "does not require grad"),
], ids=["list", "two_elements", "no_graph"])
def test_a_loss_that_cannot_be_backpropagated_fails_and_keeps_amp(make_loss, exc, pattern, gen):
    # The last two are PEER-SAME: torch's backward raises the same errors under Apex.
    model, opt = o2(gen)
    loss = make_loss(model, batch(gen))
    before = amp_world([model], [opt])
    with pytest.raises(exc, match=pattern):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.zero_grad()
    assert_same_world(before, amp_world([model], [opt]))


def test_o1_handle_casts_see_a_fused_step(gen):
    """amp.init()'s cast cache is keyed on each weight's version counter, which torch.optim's steps
    move: the forward after a FusedSGD step was served the casts of the old weights."""
    handle = amp.init(enabled=True, dtype=torch.bfloat16)
    try:
        model = torch.nn.Linear(8, 8)
        opt = FusedSGD(model.parameters(), lr=1.0)
        x = batch(gen)
        before = model(x)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        after = model(x)
        with amp.disable_casts():
            expected = torch.nn.functional.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16())
        assert not torch.equal(before, after)
        assert_bitwise_equal(after, expected)
    finally:
        handle._deactivate()


@pytest.mark.parametrize("module, name, exc, pattern", [
    ("torch", "mm", TypeError, "module must be the module or class object .* got the string 'torch'"),
    (torch, 3, TypeError, "function_name must be a string, got int"),
    (torch, "float16", TypeError, "torch.float16 is a dtype, not a function"),
    (torch, "no_such_function", ValueError, r"No function named no_such_function in module .*\(amp.register_half_function\)"),
], ids=["module_by_name", "name_not_str", "not_callable", "missing"])
def test_register_refuses_what_it_cannot_wrap_and_patches_nothing(module, name, exc, pattern):
    """A module given by name was reported as lacking the function; torch.float16 was replaced by
    a cast wrapper, breaking every later dtype=torch.float16 in the process."""
    dtype, mm = torch.float16, torch.mm
    with pytest.raises(exc, match=pattern):
        amp.register_half_function(module, name)
    assert torch.float16 is dtype and torch.mm is mm
    assert torch.zeros(1, dtype=torch.float16).dtype is dtype
