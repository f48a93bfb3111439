"""Work buffers reused from call to call, for temporaries of a few MiB made again and again on a CPU.

On Linux a fresh allocation above glibc's mmap threshold is new memory, and every page of it faults
on first touch: a refresh that wrote its logits into new tensors of tens of MB spent as long in page
faults as in its softmax (docs/benchmarks.md, "Refresh buffers reused"). A :class:`Scratch` keeps one
flat buffer per name, device and dtype, grown to the largest size asked for, and hands out views of
it. A view is valid until the next :meth:`Scratch.take` of the same name: take them for temporaries
that do not outlive the call that takes them. Only on the device types it is made for (the CPU by
default): on a GPU, PyTorch's caching allocator already reuses freed blocks, and a held buffer would
count in the allocator's peak of whatever runs next.

Buffers live while something that uses them is open: a session (or a batch decoder) takes a
:class:`ScratchHold` when it opens and lets it go when it closes; when the last hold goes, every
scratch is emptied (:func:`release_all`), so that no later run (another policy's, in ``epikv
profile``) carries the buffers in its memory figures, while a batch whose rows join through sessions
of their own, or two sessions open at once, keep theirs.
"""

from __future__ import annotations

import math
import weakref

import torch

_ALL: weakref.WeakSet[Scratch] = weakref.WeakSet()
_holds = 0  # open ScratchHolds


class Scratch:
    """Named, growable work buffers: ``take(name, shape, dtype, device)`` is a ``shape`` view of the name's buffer.

    Args:
        device_types: where buffers are kept; on other device types :meth:`take` returns a new tensor.
    """

    def __init__(self, device_types: tuple[str, ...] = ("cpu",)) -> None:
        self.device_types = device_types
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
        _ALL.add(self)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """An uninitialised contiguous ``shape`` tensor, backed by the buffer ``name`` (grown when too small)."""
        device = torch.device(device)
        if device.type not in self.device_types:
            return torch.empty(shape, dtype=dtype, device=device)
        count = math.prod(shape)
        key = (name, device, dtype)
        held = self._buffers.get(key)
        if held is None or held.numel() < count:
            held = None
            self._buffers.pop(key, None)  # the old buffer goes before the larger one is made
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                self._buffers[key] = torch.empty(count, dtype=dtype, device=device)
        return self._buffers[key][:count].view(shape)

    def nbytes(self) -> int:
        """Bytes held by every buffer."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer (the next take allocates again)."""
        self._buffers.clear()


def release_all() -> None:
    """Empty every :class:`Scratch` of the process."""
    for scratch in list(_ALL):
        scratch.clear()


class ScratchHold:
    """One user's claim on the buffers: while any hold is open, :func:`release_all` is left to the last
    one to go. :meth:`release` is idempotent."""

    def __init__(self) -> None:
        global _holds
        _holds += 1
        self.open = True

    def release(self) -> None:
        """Let go; the last open hold to go empties every scratch."""
        global _holds
        if not self.open:
            return
        self.open = False
        _holds -= 1
        if _holds == 0:
            release_all()
