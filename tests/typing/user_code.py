# A user's training script as mypy sees it: the public API keeps the types of what it is given and
# returns typed values (no Any), checked by tests/python/test_typing.py with mypy. Never executed.
from typing import assert_type

import torch

import mixprec
from mixprec import amp
from mixprec.optimizers import FusedAdam, FusedSGD

model = torch.nn.Linear(4, 4)
optimizer = FusedAdam(model.parameters(), lr=1e-3)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16)
assert_type(model, torch.nn.Linear)
assert_type(optimizer, FusedAdam)

models, optimizers = amp.initialize([model, torch.nn.Linear(4, 4)], [optimizer, FusedSGD(model.parameters(), lr=0.1)])
assert_type(models, list[torch.nn.Linear])

alone = amp.initialize(torch.nn.Conv2d(3, 3, 3), opt_level="O1")
assert_type(alone, torch.nn.Conv2d)

loss = model.forward(torch.randn(2, 4)).sum()  # model(x) is Any in torch's own hints
with amp.scale_loss(loss, optimizer) as scaled_loss:
    assert_type(scaled_loss, torch.Tensor)
    scaled_loss.backward()
optimizer.step()
checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}

scaler = mixprec.GradScaler("cuda")
assert_type(scaler.scale(loss), torch.Tensor)
scaler.step(optimizer)
scaler.update()
assert_type(scaler.get_scale(), float)
