# mixprec.amp's API surface: initialize's validation (as Apex's), return shapes and identity,
# disable_casts and the cast decorators, the rate-limited rank-0 overflow log, skipped steps and
# scale history, LR schedulers, DDP and torch.compile after initialize, and no host sync (CUDA).
from __future__ import annotations

import gc
import logging
import math
import types

import pytest
import torch

import mixprec.amp._scaler as amp_scaler
from amp_support import make_model, make_optimizers, one_cpu_thread  # noqa: F401  (autouse fixture)
from conftest import DEVICES, random_tensor
from mixprec import amp
from mixprec.amp import _amp_state
from mixprec.optimizers import FusedAdam


def model_and_opt(gen, device="cpu", kind="torch"):
    model = make_model(gen, device)
    return model, make_optimizers(kind, model)[0]


def step(model, opt, device="cpu", poison=None, loss_id=0):
    opt.zero_grad()
    loss = model(torch.randn(16, 8, device=device)).float().pow(2).mean()
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
        if poison is not None:
            model[0].weight.grad.view(-1)[0] = poison
    opt.step()


# -- initialize: validation, as Apex did ------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(opt_level="O4"), RuntimeError, "Unexpected optimization level"),
    (dict(opt_level="01"), RuntimeError, "letter O"),
    (dict(opt_level="O1", cast_model_type=torch.float16), RuntimeError, "O1 inserts casts"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), RuntimeError, "keep_batchnorm_fp32 should be None"),
    (dict(opt_level="O1", master_weights=True), RuntimeError, "master_weights with O1"),
    (dict(opt_level="O2", patch_torch_functions=True), RuntimeError, "patch_torch_functions"),
    (dict(opt_level="O2", keep_batchnorm_fp32="maybe"), AssertionError, "keep_batchnorm_fp32 must be"),
    (dict(opt_level="O0", master_weights=True), RuntimeError, "master_weights=True needs"),
    (dict(opt_level="O2", loss_scale="big"), ValueError, "loss_scale"),
    (dict(opt_level="O2", loss_scale=-4.0), ValueError, "loss_scale"),
    (dict(opt_level="O2", dtype=torch.float32), ValueError, "dtype"),
    (dict(opt_level="O2", dtype=torch.bfloat16, cast_model_type=torch.float16), ValueError, "conflicts"),
    (dict(opt_level="O1", num_losses=0), ValueError, "num_losses"),
    (dict(opt_level="O1", min_loss_scale=8.0, max_loss_scale=4.0), ValueError, "max_loss_scale"),
    (dict(opt_level="O1", max_loss_scale=math.inf), ValueError, "max_loss_scale"),
    (dict(opt_level="O1", cast_model_outputs="half"), ValueError, "cast_model_outputs"),
])
def test_initialize_rejects_inconsistent_options_and_changes_nothing(kwargs, exc, match, gen):
    model, opt = model_and_opt(gen)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(exc, match=match):
        amp.initialize(model, opt, **kwargs)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, model.parameters()))
    assert not hasattr(opt, "_amp_stash") and "forward" not in model.__dict__


def test_initialize_accepts_apex_spellings(gen):
    model, opt = model_and_opt(gen)
    amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="True", loss_scale="128.0", verbosity=0)
    assert _amp_state.opt_properties.keep_batchnorm_fp32 is True
    assert _amp_state.opt_properties.loss_scale == 128.0 and amp.loss_scale() == 128.0
    model, opt = model_and_opt(gen)
    amp.initialize(model, opt, opt_level="O1", cast_model_type=torch.float32, verbosity=0)  # allowed by Apex


def test_initialize_rejects_bad_models_and_optimizers(gen):
    model, opt = model_and_opt(gen)
    with pytest.raises(TypeError, match="models must be either a single model or a list of models"):
        amp.initialize([model, "x"], opt)
    with pytest.raises(TypeError, match="optimizers must be either a single optimizer or a list"):
        amp.initialize(model, [opt, 3])
    with pytest.raises(RuntimeError, match="Parallel wrappers should only be applied"):
        amp.initialize(torch.nn.DataParallel(model), opt)
    half, opt_half = model_and_opt(gen)
    half.half()
    with pytest.raises(RuntimeError, match="you do not need to call .half"):
        amp.initialize(half, opt_half)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    other = make_model(gen, "cpu")
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(other, opt, opt_level="O1")


def test_returns_the_shape_given_and_the_same_objects(gen):
    m1, o1 = model_and_opt(gen)
    m2, o2 = model_and_opt(gen, kind="fused")
    out = amp.initialize(m1, verbosity=0)
    assert out is m1
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O1", verbosity=0)
    assert models[0] is m1 and models[1] is m2 and opts[0] is o1 and opts[1] is o2
    m3, o3 = model_and_opt(gen)
    models, opt = amp.initialize([m3], o3, opt_level="O2", verbosity=0)
    assert isinstance(models, list) and opt is o3 and isinstance(opt, torch.optim.Adam)
    m4, o4 = model_and_opt(gen)
    model, opts = amp.initialize(m4, [o4], opt_level="O3", verbosity=0)
    assert model is m4 and opts == [o4]


def test_disabled_amp_changes_nothing(gen):
    model, opt = model_and_opt(gen)
    m, o = amp.initialize(model, opt, enabled=False)
    assert m is model and o is opt and not hasattr(opt, "_amp_stash")
    loss = model(torch.randn(4, 8)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


def test_scale_loss_misuse(gen):
    model, opt = model_and_opt(gen)
    _amp_state.opt_properties = None
    with pytest.raises(RuntimeError, match="has not been initialized"):
        with amp.scale_loss(torch.ones(()), opt):
            pass
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    stranger = torch.optim.SGD(make_model(gen, "cpu").parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="not returned by amp.initialize"):
        with amp.scale_loss(torch.ones(()), stranger):
            pass
    with pytest.raises(ValueError, match="loss_id"):
        with amp.scale_loss(torch.ones(()), opt, loss_id=1):
            pass
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)


# -- casts -------------------------------------------------------------------------------------------
class WithCustomOps(torch.nn.Module):
    """A model whose forward uses disable_casts() and a decorated function."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = {}

    def forward(self, x):
        y = self.lin(x)
        self.seen["autocast"] = y.dtype
        with amp.disable_casts():
            z = torch.mm(x, self.lin.weight.t())
            self.seen["disabled"] = z.dtype
        self.seen["float_fn"] = float_fn(y).dtype
        self.seen["half_fn"] = half_fn(x).dtype
        self.seen["promote_fn"] = promote_fn(y, x).dtype
        return y


@amp.float_function
def float_fn(t):
    assert not torch.is_autocast_enabled(t.device.type), "decorated functions run with autocast off"
    return torch.mm(t, t.t())


@amp.half_function
def half_fn(t):
    return t * 2


@amp.promote_function
def promote_fn(a, b):
    assert a.dtype == b.dtype
    return torch.mm(a, b.t())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_runs_forward_under_autocast_and_disable_casts_works(device, dtype):
    model = WithCustomOps().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=dtype, verbosity=0)
    model(torch.randn(3, 4, device=device))
    assert model.seen == {"autocast": dtype, "disabled": torch.float32, "float_fn": torch.float32,
                          "half_fn": dtype, "promote_fn": torch.float32}
    assert not torch.is_autocast_enabled(torch.device(device).type), "autocast must not leak out of forward"
    # Outside amp's casts the decorated functions run as written.
    x = torch.randn(3, 4, device=device)
    assert half_fn(x).dtype == torch.float32 and promote_fn(x.half(), x.half()).dtype == torch.float16


def test_cast_model_outputs_and_o2_input_casts(gen):
    model, opt = model_and_opt(gen)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_outputs=torch.float16, verbosity=0)
    assert model(torch.randn(4, 8)).dtype == torch.float16
    assert model({"x": torch.randn(4, 8)}["x"]).dtype == torch.float16
    model2, opt2 = model_and_opt(gen)
    model2, opt2 = amp.initialize(model2, opt2, opt_level="O1", cast_model_outputs=torch.bfloat16, verbosity=0)
    assert model2(torch.randn(4, 8)).dtype == torch.bfloat16
    model3, opt3 = model_and_opt(gen)
    model3, opt3 = amp.initialize(model3, opt3, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    assert model3(torch.randn(4, 8)).dtype == torch.float32, "O1's default: outputs in fp32 for the loss"


def test_register_functions_wrap_once_and_validate():
    ns = types.SimpleNamespace(f=lambda a: a * 3, g=lambda a: a + 1, h=lambda a, b: a + b)
    amp.register_half_function(ns, "f")
    amp.register_float_function(ns, "g")
    amp.register_promote_function(ns, "h")
    amp.register_half_function(ns, "f")  # again: still one wrapper
    assert getattr(ns.f, "__mixprec_amp_cast__") == "half" and ns.f.__wrapped__.__name__ == "<lambda>"
    x = torch.randn(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ns.f(x).dtype == torch.bfloat16
        assert ns.g(x.bfloat16()).dtype == torch.float32
        assert ns.h(x.bfloat16(), x).dtype == torch.float32
    assert ns.f(x).dtype == torch.float32
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_float_function(ns, "nope")


# -- overflow log, skipped steps, history ----------------------------------------------------------------
def overflow_records(caplog):
    return [r for r in caplog.records if r.name == "mixprec.amp" and "Gradient overflow" in r.getMessage()]


def test_overflow_log_is_rate_limited_and_counts_skips(gen, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="mixprec.amp")
    monkeypatch.setattr(amp_scaler, "LOG_INTERVAL_S", 3600.0)
    model, opt = model_and_opt(gen)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=1, scale_history=8)
    for i in range(5):
        step(model, opt, poison=math.inf if i in (0, 1, 3) else None)
    records = overflow_records(caplog)
    assert len(records) == 1, "one message per interval"
    assert "loss scaler 0 reducing loss scale to 32768.0" in records[0].getMessage()
    assert amp.skipped_steps() == 3 and amp.skipped_steps(0) == 3
    assert amp.scale_history() == [2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**13]
    assert [f for _, f in amp.scale_history(with_overflow=True)] == [True, True, False, True, False]

    caplog.clear()
    monkeypatch.setattr(amp_scaler, "LOG_INTERVAL_S", 0.0)
    model, opt = model_and_opt(gen)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=1)
    for i in range(4):
        step(model, opt, poison=math.inf if i in (0, 2) else None)
    assert len(overflow_records(caplog)) == 2
    assert "2 in total" in overflow_records(caplog)[-1].getMessage()


def test_overflow_log_only_on_rank0_and_silenced_by_verbosity_0(gen, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="mixprec.amp")
    monkeypatch.setattr(amp_scaler, "LOG_INTERVAL_S", 0.0)
    for verbosity, rank0 in ((1, False), (0, True)):
        monkeypatch.setattr(amp_scaler, "_is_rank0", lambda: rank0)
        model, opt = model_and_opt(gen)
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=verbosity)
        step(model, opt, poison=math.nan)
        step(model, opt)
        assert amp.skipped_steps() == 1
    assert overflow_records(caplog) == []


def test_overflow_skips_every_optimizer_of_the_block(gen):
    model = make_model(gen, "cpu")
    opts = make_optimizers("two", model)
    model, opts = amp.initialize(model, opts, opt_level="O2", verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    for o in opts:
        o.zero_grad()
    with amp.scale_loss(model(torch.randn(16, 8)).pow(2).mean(), opts) as scaled:
        scaled.backward()
        model[3].weight.grad.view(-1)[0] = math.inf  # the second optimizer's param only
    for o in opts:
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert amp.loss_scale() == 2.0**15


def test_delay_overflow_check_updates_at_the_step(gen):
    model, opt = model_and_opt(gen, kind="fused")
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(16, 8)).pow(2).mean(), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
        model[0].weight.grad.view(-1)[0] = math.inf
    assert amp.loss_scale() == 2.0**16, "not yet updated"
    opt.step()
    assert amp.loss_scale() == 2.0**15 and amp.skipped_steps() == 1


# -- interplay with torch --------------------------------------------------------------------------------
def test_lr_scheduler_wraps_the_patched_step_without_warnings(gen, recwarn):
    model, opt = model_and_opt(gen)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step(model, opt, poison=math.inf)  # a skipped step still counts as a call of step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def test_ddp_after_initialize_matches_plain_run(gen, tmp_path):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    model0 = make_model(gen, "cpu")
    data = [torch.randn(16, 8, generator=gen) for _ in range(3)]
    results = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for use_ddp in (False, True):
            model = make_model(torch.Generator().manual_seed(0), "cpu")
            model.load_state_dict(model0.state_dict())
            opt = FusedAdam(model.parameters(), lr=1e-2)
            # Outputs kept in bf16, so that their dtype shows the forward ran under autocast.
            model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16,
                                        cast_model_outputs=torch.bfloat16, verbosity=0)
            runner = torch.nn.parallel.DistributedDataParallel(model) if use_ddp else model
            for x in data:
                opt.zero_grad()
                out = runner(x)
                assert out.dtype == torch.bfloat16, "the forward runs under autocast inside DDP"
                with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
                    scaled.backward()
                opt.step()
            results.append([p.detach().clone() for p in model.parameters()])
            # DDP's reducer holds the process group: free it while the group lives. Dropped after
            # destroy_process_group, its last reference ran the gloo group's destructor, which
            # hung the pytest process once (CI, 2026-12-03: joining the group's worker threads).
            del runner
            gc.collect()
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_torch_compile_after_initialize(gen):
    model, opt = model_and_opt(gen)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    model.eval()
    x = torch.randn(16, 8)
    compiled = torch.compile(model, backend="eager")
    out = compiled(x)
    assert out.dtype == torch.float32  # O1 casts outputs to fp32 for the loss
    assert torch.equal(out, out.bfloat16().float()), "the compiled forward ran under autocast"
    assert torch.equal(out, model(x))


@pytest.mark.parametrize("device", DEVICES)
def test_master_params_without_amp_and_zero_grad(device, gen):
    model, opt = model_and_opt(gen, device)
    assert list(amp.master_params(opt)) == list(model.parameters())  # not processed: its params
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with amp.scale_loss(model(torch.randn(16, 8, device=device)).pow(2).mean(), opt) as scaled:
        scaled.backward()
    assert all(m.grad is not None for m in amp.master_params(opt))
    opt.zero_grad()
    assert all(m.grad is None for m in amp.master_params(opt)) and all(p.grad is None for p in model.parameters())


def test_add_param_group_under_o2_makes_masters(gen):
    for kind in ("torch", "fused"):
        model = make_model(gen, "cpu")
        first = list(model[0].parameters()) + list(model[1].parameters())
        opt = torch.optim.Adam(first, lr=1e-2) if kind == "torch" else FusedAdam(first, lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        opt.add_param_group({"params": model[3].parameters(), "lr": 1e-3})
        masters = list(amp.master_params(opt))
        assert len(masters) == len(list(model.parameters())) and all(m.dtype == torch.float32 for m in masters)
        before = model[3].weight.detach().clone()
        step(model, opt)
        assert not torch.equal(before, model[3].weight), "the added group trains"


@pytest.mark.cuda
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("kind", ["fused", "torch", "two"])
def test_cuda_amp_steps_never_sync(level, kind, gen):
    model = make_model(gen, "cuda")
    opts = make_optimizers(kind, model)
    model, opts = amp.initialize(model, opts, opt_level=level, verbosity=1, max_loss_scale=2.0**10)
    data = [random_tensor((16, 8), torch.float32, "cuda", gen) for _ in range(6)]

    def one(x, poison=None):
        for o in opts:
            o.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opts) as scaled:
            scaled.backward()
            if poison is not None:
                model[0].weight.grad.view(-1)[1].fill_(poison)  # no host-to-device copy, no sync
        for o in opts:
            o.step()

    one(data[0])  # warm-up: state creation may sync once
    before = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, x in enumerate(data[1:]):
            if i == 2:
                torch.cuda.set_sync_debug_mode("default")
                before = [p.detach().clone() for p in model.parameters()]
                torch.cuda.set_sync_debug_mode("error")
            one(x, poison=math.inf if i == 2 else None)
            if i == 2:
                torch.cuda.set_sync_debug_mode("default")
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                torch.cuda.set_sync_debug_mode("error")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert amp.skipped_steps() == 1
