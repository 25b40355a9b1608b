# Tests of amp.initialize's O2 with cast_model_type=False, as Apex documents it: the model is not cast,
# and the fp32 master weights O2 keeps are made for the params that arrive in fp16 (none for fp32 ones).
from __future__ import annotations

import pytest
import torch

from mixprec import amp
from mixprec.amp import _amp_state


class TwoDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w32 = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        self.w16 = torch.nn.Parameter(torch.tensor([2.0, 3.0], dtype=torch.float16))

    def forward(self, x):
        return (x * self.w32 * self.w16.float()).sum()


@pytest.fixture
def fp16_model_allowed():
    _amp_state.allow_incoming_model_not_fp32 = True
    yield
    _amp_state.allow_incoming_model_not_fp32 = False


def test_o2_without_cast_keeps_masters_for_fp16_params_only(fp16_model_allowed):
    model = TwoDtypes()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # A static scale: at 2**16 the fp16 gradient (131072) would overflow and the step be skipped.
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=False, loss_scale=128.0, verbosity=0)
    assert model.w32.dtype == torch.float32 and model.w16.dtype == torch.float16  # not cast
    masters = list(amp.master_params(opt))
    assert [m.dtype for m in masters] == [torch.float32, torch.float32]
    assert masters[0] is model.w32 and masters[1] is not model.w16  # a master for the fp16 param only

    x = torch.tensor([1.0, 1.0])
    opt.zero_grad()
    with amp.scale_loss(model(x), opt) as scaled:
        scaled.backward()
    opt.step()
    # d/dw32 = x * w16 = (2, 3); d/dw16 = x * w32 = (1, 2); lr 0.5
    torch.testing.assert_close(model.w32.detach(), torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(model.w16.detach(), torch.tensor([1.5, 2.0], dtype=torch.float16))
    torch.testing.assert_close(masters[1].detach(), torch.tensor([1.5, 2.0]))


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_an_explicit_master_weights_without_a_cast_is_still_refused(opt_level):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="master_weights"):
        amp.initialize(model, opt, opt_level=opt_level, master_weights=True, verbosity=0)
