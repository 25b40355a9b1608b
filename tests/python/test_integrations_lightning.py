# mixprec.integrations.lightning on the CPU: the Trainer and Fabric with MixprecPrecision train exactly
# as amp does by hand (O2 masters, clipping on unscaled grads), skip overflowing steps and resume bit for bit.
from __future__ import annotations

import logging
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")

from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402
from test_integrations_support import (  # noqa: E402
    CLIP,
    assert_o2_layout,
    assert_same,
    make_optimizer,
    reference_run,
    snapshot,
    tiny_data,
    tiny_net,
)

F = torch.nn.functional
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's "few workers" advice on tiny loaders


class Tiny(L.LightningModule):
    """tiny_net in a LightningModule; ``inject_at``: the global step whose gradient holds an inf."""

    def __init__(self, seed: int = 0, inject_at: int = -1):
        super().__init__()
        self.net = tiny_net(seed)
        self.inject_at = inject_at
        self.losses: list[float] = []
        self.before: list[dict] = []  # state at each batch start: after the previous step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.global_step == self.inject_at:  # the loss stays finite, one gradient is inf
            out.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        loss = F.cross_entropy(out, y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.before.append({**snapshot(self.net, self.trainer.optimizers[0]),
                            "scale": self.trainer.precision_plugin.state_dict()["loss_scaler0"]["loss_scale"]})

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


def make_trainer(plugin, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def loader(batches):
    return torch.utils.data.DataLoader(batches, batch_size=None)  # the prepared batches, in order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_trainer_o2_trains_exactly_like_amp_by_hand(dtype):
    batches = tiny_data()
    model, plugin = Tiny(), MixprecPrecision("O2", dtype=dtype, verbosity=0)
    trainer = make_trainer(plugin, max_epochs=3, gradient_clip_val=CLIP)
    trainer.fit(model, loader(batches))
    optimizer = trainer.optimizers[0]

    ref_model, ref_opt, ref_losses, norms = reference_run(tiny_net(0), batches, 3, "O2", dtype, clip=CLIP)
    assert sum(n > CLIP for n in norms) > len(norms) // 2  # clipping acted on most steps
    assert model.losses == ref_losses
    assert sum(ref_losses[-4:]) < 0.8 * sum(ref_losses[:4])
    assert_o2_layout(model.net, optimizer, dtype)
    assert_same(snapshot(model.net, optimizer), snapshot(ref_model, ref_opt), "Trainer vs amp by hand")
    assert trainer.precision == ("16-mixed" if dtype == torch.float16 else "bf16-mixed")


@pytest.mark.parametrize("dtype,loss_scale", [(torch.float16, None), (torch.bfloat16, "dynamic")],
                         ids=["fp16", "bf16-dynamic"])
def test_trainer_skips_a_step_with_an_inf_gradient_and_backs_off(dtype, loss_scale):
    model, plugin = Tiny(inject_at=2), MixprecPrecision("O2", dtype=dtype, loss_scale=loss_scale, verbosity=0)
    trainer = make_trainer(plugin, max_steps=5, gradient_clip_val=CLIP)
    trainer.fit(model, loader(tiny_data()))
    before, after, later = model.before[2], model.before[3], model.before[4]
    scale = before.pop("scale")
    assert after.pop("scale") == scale / 2 and later.pop("scale") == scale / 2
    assert_same(after, before, "the overflowing step")  # params, masters, moments and step count untouched
    assert any(not torch.equal(after[k], later[k]) for k in after if k.startswith("model.")), "the next step trains"
    assert plugin.state_dict()["loss_scaler0"]["_skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_trainer_checkpoint_resumes_bit_for_bit(tmp_path):
    batches, path = tiny_data(), tmp_path / "half.ckpt"

    def fit(model, epochs, ckpt=None):
        plugin = MixprecPrecision("O2", verbosity=0)
        trainer = make_trainer(plugin, max_epochs=epochs, gradient_clip_val=CLIP)
        trainer.fit(model, loader(batches), ckpt_path=ckpt)
        return trainer, plugin

    # An overflow in the first half halves the scale: the resumed run must get it back.
    full = Tiny(inject_at=1)
    full_trainer, full_plugin = fit(full, 4)
    full_state = snapshot(full.net, full_trainer.optimizers[0])
    full_scaler = full_plugin.state_dict()  # amp's scalers are process-wide: read before the next run
    half_trainer, _ = fit(Tiny(inject_at=1), 2)
    half_trainer.save_checkpoint(path)

    saved = torch.load(path, weights_only=True)
    assert saved["MixprecPrecision"]["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    assert all("master_param" in s for s in saved["optimizer_states"][0]["state"].values())

    resumed = Tiny(seed=1)  # other initial weights: everything must come from the checkpoint
    trainer, plugin = fit(resumed, 4, ckpt=str(path))
    assert resumed.losses == full.losses[len(batches) * 2:]
    assert_same(snapshot(resumed.net, trainer.optimizers[0]), full_state, "resumed vs uninterrupted")
    assert plugin.state_dict() == full_scaler
    with pytest.raises(RuntimeError, match="amp.initialize was called again elsewhere"):
        full_plugin.state_dict()  # a finished run's plugin cannot save another run's scaler


class Manual(Tiny):
    """Manual optimization: manual_backward scales for the plugin's optimizers, step() steps."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        optimizer.step()
        self.losses.append(loss.item())


def test_trainer_manual_optimization_trains_like_amp_by_hand():
    batches = tiny_data()
    model, plugin = Manual(), MixprecPrecision("O2", verbosity=0)
    trainer = make_trainer(plugin, max_epochs=2)
    trainer.fit(model, loader(batches))
    trained = snapshot(model.net, trainer.optimizers[0])
    ref_model, ref_opt, ref_losses, _ = reference_run(tiny_net(0), batches, 2, clip=CLIP)
    assert model.losses == ref_losses
    assert_same(trained, snapshot(ref_model, ref_opt), "manual optimization vs amp by hand")


def test_fabric_o2_trains_like_amp_by_hand_and_saves_its_scaler(tmp_path):
    batches, path = tiny_data(), tmp_path / "fabric.ckpt"

    def setup(seed):
        plugin = MixprecPrecision("O2", verbosity=0)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = tiny_net(seed)
        model, optimizer = plugin.initialize(model, make_optimizer(model.parameters()))
        return (fabric, plugin, *fabric.setup(model, optimizer))

    fabric, plugin, model, optimizer = setup(0)
    losses = []
    for _ in range(3):
        for x, y in batches:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            losses.append(loss.item())
    inner = optimizer.optimizer
    assert_o2_layout(model.module, inner, torch.float16)
    trained = snapshot(model.module, inner)

    # Only the plugin's state is ours: the model before the optimizer, so the saved masters win.
    state = plugin.state_dict()
    state["loss_scaler0"].update(loss_scale=2.0 ** 10, unskipped=7)
    plugin.load_state_dict(state)
    fabric.save(path, {"model": model, "optimizer": optimizer, "amp": plugin})
    assert torch.load(path, weights_only=True)["amp"]["loss_scaler0"]["loss_scale"] == 2.0 ** 10

    ref_model, ref_opt, ref_losses, _ = reference_run(tiny_net(0), batches, 3, clip=CLIP)
    assert losses == ref_losses
    assert_same(trained, snapshot(ref_model, ref_opt), "Fabric vs amp by hand")

    fabric2, plugin2, model2, optimizer2 = setup(1)
    fabric2.load(path, {"model": model2, "optimizer": optimizer2, "amp": plugin2})
    assert_same(snapshot(model2.module, optimizer2.optimizer), trained, "Fabric load")
    assert plugin2.state_dict()["loss_scaler0"]["unskipped"] == 7


def test_pytorch_lightning_namespace_runs_o1():
    pl = pytest.importorskip("pytorch_lightning")
    from mixprec.integrations.pytorch_lightning import MixprecPrecision as PLPrecision

    class PLTiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_net(0)
            self.losses = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    batches = tiny_data()
    model, plugin = PLTiny(), PLPrecision("O1", dtype=torch.bfloat16, verbosity=0)
    assert isinstance(plugin, pl.plugins.precision.Precision)
    pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_epochs=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(model, loader(batches))
    _, _, ref_losses, _ = reference_run(tiny_net(0), batches, 2, "O1", torch.bfloat16)
    assert model.losses == ref_losses and all(p.dtype == torch.float32 for p in model.parameters())


def test_bad_arguments_are_refused_and_a_second_model_too():
    with pytest.raises(ValueError, match=r"MixprecPrecision: opt_level must be one of .*'O4'"):
        MixprecPrecision("O4")
    with pytest.raises(ValueError, match=r"MixprecPrecision: dtype must be torch.float16 or torch.bfloat16"):
        MixprecPrecision("O2", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"MixprecPrecision: loss_scale must be"):
        MixprecPrecision("O2", loss_scale=-1.0)
    with pytest.raises(TypeError, match=r"MixprecPrecision: unexpected keyword argument\(s\) \['opt_levle'\]"):
        MixprecPrecision(opt_levle="O2")
    plugin = MixprecPrecision("O2", verbosity=0)
    with pytest.raises(RuntimeError, match=r"MixprecPrecision.forward_context: amp is not initialized.*Fabric"):
        plugin.forward_context()
    model = tiny_net(0)
    optimizer = make_optimizer(model.parameters())
    plugin.initialize(model, optimizer)
    other = tiny_net(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before amp looks at it
        with pytest.raises(RuntimeError, match=r"already initialized amp for Sequential"):
            plugin.initialize(other, make_optimizer(other.parameters()))
    assert all(p.dtype == torch.float32 for p in other.parameters())
    assert plugin.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 16
