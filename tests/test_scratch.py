"""Reusable work buffers: views of one growing buffer per name, device and dtype."""

from __future__ import annotations

import torch

from epikv_cli.core.scratch import Scratch, ScratchHold, release_all


def test_take_reuses_one_buffer_per_name_and_dtype_and_grows_when_asked_for_more():
    scratch = Scratch()
    first = scratch.take("logits", (2, 3), torch.float32, "cpu")
    first.fill_(1.0)
    smaller = scratch.take("logits", (4,), torch.float32, "cpu")
    assert smaller.data_ptr() == first.data_ptr()  # the same memory, reshaped
    assert smaller.shape == (4,) and smaller.is_contiguous()
    other = scratch.take("weights", (2, 3), torch.float32, "cpu")
    half = scratch.take("logits", (2, 3), torch.bfloat16, "cpu")
    assert len({first.data_ptr(), other.data_ptr(), half.data_ptr()}) == 3
    assert scratch.nbytes() == 6 * 4 + 6 * 4 + 6 * 2
    larger = scratch.take("logits", (5, 3), torch.float32, "cpu")
    assert larger.shape == (5, 3)
    assert scratch.nbytes() == 15 * 4 + 6 * 4 + 6 * 2  # the smaller buffer was replaced, not kept beside it
    assert scratch.take("logits", (2, 3), torch.float32, "cpu").data_ptr() == larger.data_ptr()
    scratch.clear()
    assert scratch.nbytes() == 0


def test_buffers_made_in_inference_mode_are_writable_outside_it():
    """A buffer first taken under torch.inference_mode (as generation runs) is a normal tensor, so a later
    caller outside inference mode can write into it (an inference tensor would refuse in-place writes)."""
    scratch = Scratch()
    with torch.inference_mode():
        inside = scratch.take("logits", (3,), torch.float32, "cpu")
        inside.fill_(2.0)
    assert not inside.is_inference()
    outside = scratch.take("logits", (3,), torch.float32, "cpu")
    torch.mul(torch.ones(3), 5.0, out=outside)
    assert outside.tolist() == [5.0, 5.0, 5.0]


def test_other_device_types_get_a_new_tensor_each_time_and_release_all_empties_every_scratch():
    """A scratch made for no device type holds nothing (on a GPU the caching allocator reuses memory, and a
    held buffer would count in the next run's peak); release_all drops the buffers of every scratch."""
    passing = Scratch(device_types=())
    first = passing.take("logits", (4,), torch.float32, "cpu")
    second = passing.take("logits", (4,), torch.float32, "cpu")
    assert first.data_ptr() != second.data_ptr()
    assert passing.nbytes() == 0
    one, two = Scratch(), Scratch()
    one.take("a", (8,), torch.float32, "cpu")
    two.take("b", (2,), torch.int64, "cpu")
    assert (one.nbytes(), two.nbytes()) == (32, 16)
    release_all()
    assert (one.nbytes(), two.nbytes()) == (0, 0)


def test_buffers_stay_until_the_last_hold_goes():
    """Two users open at once (a batch decoder and the session a row joins through, or two sessions):
    the first to close keeps the other's buffers; the last empties every scratch; a second release of
    the same hold counts once."""
    scratch = Scratch()
    outer, inner = ScratchHold(), ScratchHold()
    scratch.take("logits", (8,), torch.float32, "cpu")
    inner.release()
    inner.release()
    assert scratch.nbytes() == 32
    outer.release()
    assert scratch.nbytes() == 0
