# The Python wrappers of mixprec.layer_norm / rms_norm / scale_: arguments that the ops would misread
# (a str split into digits, a float "not iterable", a sparse layout, a scale of the wrong shape)
# are refused by name, as torch's own functional forms refuse them.
from __future__ import annotations

import numpy as np
import pytest
import torch

import mixprec

NORMS = {"mixprec.layer_norm": mixprec.layer_norm, "mixprec.rms_norm": mixprec.rms_norm}


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("shape", [8.7, "16", b"16", [16.0], True, [True], None, object()])
def test_normalized_shape_that_is_not_ints_is_refused(name, shape):
    # Before: "16" was split into digits ([1, 6]: a size mismatch; "8" passed silently), 8.7 raised
    # "'float' object is not iterable".
    with pytest.raises(TypeError, match=rf"{name}: normalized_shape must be an int or a sequence of ints"):
        NORMS[name](torch.randn(2, 16), shape)


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("shape", [16, (16,), [16], torch.Size([16]), np.int64(16), [torch.tensor(16)]])
def test_every_int_spelling_of_normalized_shape_works(name, shape):
    x = torch.randn(2, 16)
    assert torch.equal(NORMS[name](x, shape), NORMS[name](x, 16))


@pytest.mark.parametrize("name", sorted(NORMS))
def test_a_sparse_input_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"{name}: input must be a dense \(strided\) tensor"):
        NORMS[name](torch.randn(2, 16).to_sparse(), 16)


@pytest.mark.parametrize("scale", [2.0, torch.tensor([2.0, 3.0]), torch.tensor([2.0], dtype=torch.float64)])
def test_scale_names_its_own_argument(scale):
    # Before: the messages named mixprec::non_finite_check_and_unscale_ and its 'inv_scale'.
    t = torch.ones(3)
    with pytest.raises(TypeError, match=r"mixprec.scale_: scale must be a one-element float32 tensor"):
        mixprec.scale_([t], scale)
    assert torch.equal(t, torch.ones(3))
