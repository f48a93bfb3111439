"""One read from the device per decoding step: the sampled token and the policy's host values together.

Tensors that would live on an accelerator are marked by a subclass that counts every read back to
the host (``tolist``, ``item``, ``cpu``, ``bool()``, ...). Reads inside the model's own forward are
transformers' business and are not counted; everything the engine, the cache and the policy do
around it is.
"""

from __future__ import annotations

import pytest
import torch

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.core.hostread import host_copies
from epikv_cli.policies.registry import POLICIES, parse_policy_spec
from epikv_cli.runtime.batched import BatchDecoder
from epikv_cli.runtime.batchgen import BatchedGeneration, Request
from epikv_cli.runtime.generation import Generation

from conftest import tiny_model

READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class OnDevice(torch.Tensor):
    """A tensor that stands for one on the accelerator; outside a forward, reading it counts as a sync."""

    reads = 0
    in_forward = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in READS and not cls.in_forward:
            cls.reads += 1
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.cpu:  # what reached the host is a host tensor: reading it again costs nothing
            result = result.as_subclass(torch.Tensor)
        return result


def test_host_copies_round_trip_every_dtype_exactly():
    tensors = [
        torch.tensor([3, 50000]),
        torch.tensor([[0.1, -2.5]], dtype=torch.float32),
        torch.tensor([1.5], dtype=torch.bfloat16),
    ]
    copies = host_copies(tensors)
    assert [c.shape for c in copies] == [t.shape for t in tensors]
    assert all(torch.equal(c, t.double()) for c, t in zip(copies, tensors))


@pytest.fixture
def counted_model():
    model = tiny_model("llama", seed=6)
    hooks = [
        model.register_forward_pre_hook(lambda *a: setattr(OnDevice, "in_forward", True)),
        model.register_forward_hook(lambda *a: setattr(OnDevice, "in_forward", False)),
    ]
    OnDevice.reads = 0
    yield model
    for hook in hooks:
        hook.remove()


#: Policies whose select reads the device itself (the published Lag-KV rescores the whole cache at every eviction,
#: R-KV compresses every 128 steps): a second read on their evicting steps, by definition.
READS_IN_SELECT = {"lagkv", "rkv"}
POLICIES_READING_THE_DEVICE = [
    *sorted(name for name, cls in POLICIES.items() if cls.evicts and name not in READS_IN_SELECT),
    "lagkv:chunks=positions",
]


@pytest.mark.parametrize("policy", POLICIES_READING_THE_DEVICE)
def test_a_decoding_step_reads_the_device_once(counted_model, tokenizer, policy):
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2)).as_subclass(OnDevice)
    name, options = parse_policy_spec(policy)
    budget = 30 if POLICIES[name].protects_prompt else 20
    steps = 60
    run = Generation(
        counted_model,
        tokenizer,
        ids,
        CacheSettings(budget=budget, policy=name, options=options),
        SamplingSettings(max_new_tokens=steps, ignore_eos=True),
    )
    reads = []
    for event in run:
        reads.append(OnDevice.reads)
    per_step = [b - a for a, b in zip(reads, reads[1:])]
    assert run.result.evicted > 0
    assert per_step == [1] * (steps - 1), per_step


def test_a_batched_step_reads_the_device_once_for_every_row(counted_model, tokenizer, monkeypatch):
    prompts = [
        torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)).as_subclass(OnDevice)
        for n in (7, 12, 9)
    ]
    settings = [CacheSettings(budget=24, policy=p) for p in ("epikv", "h2o", "epikv2")]
    sampling = SamplingSettings(max_new_tokens=50, ignore_eos=True)
    requests = [Request(i, ids, s, sampling) for i, (ids, s) in enumerate(zip(prompts, settings))]
    reads_before_step = []
    forward = BatchDecoder.forward

    def counted_forward(self, tokens):
        reads_before_step.append(OnDevice.reads)
        return forward(self, tokens)

    monkeypatch.setattr(BatchDecoder, "forward", counted_forward)
    results = dict(BatchedGeneration(counted_model, tokenizer, requests, batch_size=3, settings=settings))
    assert all(r.evicted > 0 for r in results.values())
    per_step = [b - a for a, b in zip(reads_before_step, reads_before_step[1:])]
    assert per_step == [1] * 48, per_step  # 50 tokens: 49 forwards after the prefills
