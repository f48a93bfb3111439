"""One device-to-host copy for everything a decoding step must read.

A step reads the sampled tokens and, for some policies, a few numbers from the forward (EpiKV's
hidden-state changes, H2O's received attention). Each read from an accelerator is a synchronisation
that drains its queue, so they are made together: every tensor is flattened to float64 (exact for
token ids and for float32/bfloat16 values) on the first tensor's device, concatenated, copied once,
and split back into CPU tensors of the original shapes.
"""

from __future__ import annotations

import torch


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU float64 copies of ``tensors``, made with a single device-to-host transfer."""
    if not tensors:
        return []
    device = tensors[0].device
    flat = torch.cat([tensor.detach().reshape(-1).to(device=device, dtype=torch.float64) for tensor in tensors]).cpu()
    return [part.view(tensor.shape) for part, tensor in zip(flat.split([t.numel() for t in tensors]), tensors)]
