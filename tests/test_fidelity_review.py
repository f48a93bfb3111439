"""Review of `epikv fidelity` and `epikv calibrate`: each test pins a defect against an independent reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from epikv_cli.errors import UsageError
from epikv_cli.experiments import calibrate as calibrate_module
from epikv_cli.experiments.calibrate import STRIDE, WINDOW, window_labels
from epikv_cli.experiments.fidelity import BudgetSpec, Config, replay
from epikv_cli.runtime.stream import CacheStream

from conftest import VOCAB, tiny_model


def test_a_per_head_policy_counts_only_the_logits_computed_after_its_first_eviction():
    """epikv2 (the default) evicts a slot per KV head but lists only the positions no head holds any more: the
    logits computed before its first eviction were counted as after it (positions_after_full one too many, the
    after-full KL and top-1 diluted by a position the full cache still held)."""
    model = tiny_model("llama", seed=6)
    prompt_len, new = 24, 60
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(4))
    config = Config("epikv2", BudgetSpec.parse("+8"))
    tokens, results = replay(model, ids, [config], new)
    # the reference: the same teacher-forced tokens through one stream, and the full model's logits
    logits, evicted = [], []
    with CacheStream(model, config.settings(prompt_len), max_tokens=prompt_len + new) as stream:
        logits.append(stream.feed(ids))
        evicted.append(stream.cache.evicted_total)
        for token in tokens[:-1]:
            logits.append(stream.feed(torch.tensor([[token]])))
            evicted.append(stream.cache.evicted_total)
    policy = torch.log_softmax(torch.stack(logits).double(), -1)
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([ids[0].tolist() + tokens[:-1]])).logits[0, prompt_len - 1 :], -1)
    kl = torch.nn.functional.kl_div(policy, full.double(), log_target=True, reduction="none").sum(-1)
    after = torch.tensor([False] + [total > 0 for total in evicted[:-1]])  # evicted before the forward of step i
    assert evicted[0] == 0 and 0 < int(after.sum()) < new  # the prefill held the prompt; the cache filled later
    assert results[0]["positions_after_full"] == int(after.sum())
    assert results[0]["kl_after_full"] == pytest.approx(float(kl[after].mean()), rel=1e-3, abs=1e-7)
    top1 = (policy.argmax(-1) == torch.tensor(tokens))[after].double().mean()
    assert results[0]["top1_after_full"] == pytest.approx(float(top1))


def test_window_labels_hide_the_window_from_the_full_layers_and_keep_the_sliding_window():
    """A 4D mask replaces every mask the model builds: on Gemma 3 the local layers lost their sliding window, so
    each label measured a full-attention model against the sliding one, not the window's importance."""
    model = tiny_model("gemma3", seed=9)
    prompt_len, new = 10, 60
    sequence = torch.randint(0, 256, (prompt_len + new - 1,), generator=torch.Generator().manual_seed(2)).tolist()
    labels = window_labels(model, sequence, prompt_len, new)
    assert [start for start, _ in labels] == list(range(0, new - WINDOW - 1, STRIDE))
    ids = torch.tensor([sequence])
    total = len(sequence)
    shape = {
        "config": model.config,
        "inputs_embeds": torch.zeros(1, total, model.config.hidden_size),
        "attention_mask": None,
        "cache": None,
        "position_ids": torch.arange(total).unsqueeze(0),
        "allow_is_causal_skip": False,
    }
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits[0].double(), -1)
        for start, label in labels:
            first, last = prompt_len + start, prompt_len + start + WINDOW

            def hole(batch, head, q, kv, first=first, last=last):
                return ~((q >= last) & (kv >= first) & (kv < last))

            # transformers' own masks: the window hidden from the global layer, the local layers' own window
            mask = {
                "full_attention": create_causal_mask(**shape, and_mask_function=hole),
                "sliding_attention": create_sliding_window_causal_mask(**shape),
            }
            hidden = torch.log_softmax(model(ids, attention_mask=mask).logits[0, last:].double(), -1)
            expected = (reference[last:].exp() * (reference[last:] - hidden)).sum(-1).mean()
            assert label == pytest.approx(float(expected), rel=1e-3, abs=1e-7)


class ElsewhereModel(torch.nn.Module):
    """A model whose weights live on another device than the CPU (as on a GPU; here the meta device): it records
    the devices of the tensors each forward is given and answers zero logits."""

    def __init__(self) -> None:
        super().__init__()
        self.config = tiny_model("llama").config
        self.embed = torch.nn.Embedding(VOCAB, 8, device="meta")
        self.devices: list[set[str]] = []

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        masks = list(attention_mask.values()) if isinstance(attention_mask, dict) else [attention_mask]
        self.devices.append({t.device.type for t in [input_ids, *masks] if t is not None})
        return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], VOCAB))


def test_window_labels_give_the_model_its_inputs_on_its_device():
    """The ids and masks were made on the CPU: on a CUDA model every `epikv calibrate` died in the first masked
    forward (tensors on two devices)."""
    model = ElsewhereModel()
    labels = window_labels(model, list(range(10, 79)), 10, 60)
    assert len(labels) == len(range(0, 60 - WINDOW - 1, STRIDE))
    assert model.devices == [{"meta"}] * (1 + len(labels))


def test_a_model_whose_every_layer_slides_is_refused_before_any_trace(monkeypatch):
    """No budget evicts from such a model (generate refuses any evicting policy on it): calibrate measured windows
    hidden from layers that eviction never touches, and saved bands no run could use."""
    model = tiny_model("mistral", sliding_window=8)

    def no_trace(*args, **kwargs):
        raise AssertionError("a reference trace ran")

    monkeypatch.setattr(calibrate_module, "trace", no_trace)
    with pytest.raises(UsageError, match="every layer of this model uses sliding-window attention"):
        calibrate_module.calibrate(model, [torch.tensor([[1, 2, 3]])], 64)
