"""The test setup poisons fresh buffers, so that a kernel leaving part of its output unwritten fails."""

import torch


def test_fresh_float_buffers_are_nan_whichever_way_they_are_made():
    base = torch.zeros(3, 5)
    for made in (torch.empty(3, 5), torch.empty_like(base), base.new_empty(3, 5), base.new_empty((2, 2))):
        assert torch.isnan(made).all()


def test_fresh_integer_buffers_hold_a_large_negative_number():
    index = torch.zeros(4, dtype=torch.int32)
    for made in (torch.empty(4, dtype=torch.int64), torch.empty_like(index), index.new_empty(4)):
        assert (made == -(2**30)).all()
