"""Several processes over one prompt file: ``accelerate launch --num_processes N`` or ``torchrun``.

Each rank takes every N-th prompt, loads the model on its own device and appends its results to
the shared output; rank 0 puts the file back in input order at the end.

A rank whose prompt fails records the error and goes on, so every rank reaches the same
synchronisation points. A rank that dies (killed, or an error outside any prompt) makes the
launcher stop the others (torchrun and accelerate launch do); if they are still waiting, the broken
connection turns into :class:`PeerFailed` and they exit with one line, never hanging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch

from epikv_cli.errors import UsageError

#: How long a rank waits at a synchronisation point for the others: the last rank to finish may
#: still be generating a long answer (the default of torch.distributed, 30 minutes, is too short).
SYNC_TIMEOUT = timedelta(hours=24)


class PeerFailed(RuntimeError):
    """Another process of the launch stopped before reaching a synchronisation point."""


@dataclass
class Ranks:
    """This process's place among the launched ones (``world == 1`` when not launched)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    state: Any = None  # accelerate.PartialState when launched

    @classmethod
    def from_env(cls) -> Ranks:
        """Join the process group when a launcher set ``WORLD_SIZE > 1``; otherwise a single rank."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:  # WORLD_SIZE set by hand, or left over from another job: no launcher started this process
            verb = "is" if len(missing) == 1 else "are"
            raise UsageError(
                f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} {verb} not set: start the "
                "processes with torchrun or accelerate launch, or unset WORLD_SIZE"
            )
        from accelerate import PartialState  # noqa: PLC0415 (accelerate: its distributed state only for multi-process runs)

        state = PartialState(cpu=not torch.cuda.is_available(), timeout=SYNC_TIMEOUT)
        return cls(state.process_index, state.num_processes, state.local_process_index, state)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence) -> list:
        """This rank's share: every ``world``-th item starting at ``rank`` (balanced, order kept)."""
        return list(items[self.rank :: self.world])

    def device_map(self, requested: str) -> str:
        """One whole model per rank: its own GPU when there are GPUs, else the CPU."""
        if self.world == 1:
            return requested
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    def barrier(self) -> None:
        """Wait for every rank; :class:`PeerFailed` if one of them is gone."""
        if self.state is not None:
            try:
                self.state.wait_for_everyone()
            except RuntimeError as error:  # gloo and NCCL report a vanished peer as RuntimeError (DistError)
                raise PeerFailed(str(error)) from None

    def close(self) -> None:
        """Leave the process group (exiting without it makes gloo abort the process)."""
        if self.state is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self.state = None

    def total(self, value: int) -> int:
        """Sum of ``value`` over all ranks."""
        if self.state is None:
            return value
        from accelerate.utils import gather_object  # noqa: PLC0415 (accelerate: its distributed state only for multi-process runs)

        try:
            return sum(gather_object([value]))
        except RuntimeError as error:
            raise PeerFailed(str(error)) from None
