"""Resolving --model and choosing the attention implementation."""

from __future__ import annotations

import pytest
import torch

from epikv_cli.config import ModelSettings
from epikv_cli.errors import ModelLoadError, UsageError
from epikv_cli.models import loading
from epikv_cli.models.loading import choose_attn, load, resolve_source


def test_resolve_directory(tiny_model_dir):
    assert resolve_source(str(tiny_model_dir)).kind == "dir"


def test_resolve_directory_without_config(tmp_path):
    with pytest.raises(UsageError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_resolve_gguf(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    source = resolve_source(str(gguf))
    assert (source.kind, source.gguf_file, source.root) == ("gguf", "m.gguf", str(tmp_path))


@pytest.mark.parametrize("spec", ["/no/such/dir", "./relative/missing", "a/b/c", "missing.gguf", "bad id!"])
def test_resolve_missing_paths(spec):
    with pytest.raises(UsageError):
        resolve_source(spec)


@pytest.mark.parametrize("spec", ["Qwen/QwQ-32B", "gpt2", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"])
def test_resolve_hub_ids(spec):
    assert resolve_source(spec).kind == "hub"


def test_unreachable_hub_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="Hugging Face Hub"):
        load(ModelSettings(model="nobody-here/no-such-model"))


def test_load_local_directory(tiny_model_dir):
    loaded = load(ModelSettings(model=str(tiny_model_dir), dtype="bfloat16"))
    assert loaded.model.dtype == torch.bfloat16 and loaded.attn == "sdpa"
    assert loaded.model.config._attn_implementation == "sdpa"
    assert load(ModelSettings(model=str(tiny_model_dir), attn="eager")).model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    "dtype, native, said",
    [("bfloat16", False, True), ("bfloat16", True, False), ("float32", False, False), ("auto", False, False)],
)
def test_bfloat16_on_a_cpu_without_its_instructions_is_said_once(tiny_model_dir, monkeypatch, dtype, native, said):
    """A status line (``-q`` silences status) when the weights are bfloat16 on a CPU that lacks bfloat16 hardware, as
    on an AVX2 machine (the tiny model's checkpoint is float32, so ``auto`` is float32)."""
    monkeypatch.setattr(loading, "native_bfloat16", lambda: native)
    lines: list[str] = []
    load(ModelSettings(model=str(tiny_model_dir), dtype=dtype), lines.append)
    slow = loading.SLOW_BFLOAT16.format(capability=torch.backends.cpu.get_cpu_capability())
    assert lines == ([slow] if said else [])


@pytest.mark.parametrize(
    "requested, on_cuda, flash, model_type, dtype, expected",
    [
        ("auto", False, False, "llama", torch.float32, "sdpa"),
        ("auto", False, True, "llama", torch.bfloat16, "sdpa"),  # flash-attn needs CUDA
        ("auto", True, False, "llama", torch.bfloat16, "sdpa"),  # not installed
        ("auto", True, True, "llama", torch.bfloat16, "flash_attention_2"),
        ("auto", True, True, "llama", torch.float32, "sdpa"),  # flash kernels need half precision
        ("auto", True, True, "gemma2", torch.bfloat16, "eager"),
        ("eager", True, True, "llama", torch.bfloat16, "eager"),
        ("sdpa", True, True, "llama", torch.bfloat16, "sdpa"),
    ],
)
def test_choose_attn(requested, on_cuda, flash, model_type, dtype, expected):
    assert (
        choose_attn(requested, on_cuda=on_cuda, flash_available=flash, model_type=model_type, dtype=dtype) == expected
    )


@pytest.mark.parametrize("on_cuda, flash", [(False, True), (True, False)])
def test_forcing_flash_attention_without_it_is_a_usage_error(on_cuda, flash):
    with pytest.raises(UsageError, match="flash-attn"):
        choose_attn(
            "flash_attention_2", on_cuda=on_cuda, flash_available=flash, model_type="llama", dtype=torch.bfloat16
        )


def test_unknown_attn_is_a_usage_error():
    with pytest.raises(UsageError, match="--attn"):
        choose_attn("paged", on_cuda=False, flash_available=False, model_type="llama", dtype=None)


@pytest.mark.long
def test_a_compiled_forward_runs_the_hooks_of_sessions_attached_after_it_was_traced():
    """The first compile traced a forward without hidden-state taps (streaming needs none); epikv then hooks
    the decoder blocks. Its hooks must run (the graph recompiles), giving the tokens of the plain forward."""
    import epikv_cli
    from epikv_cli.models.loading import compile_forward

    from conftest import tiny_model

    model = tiny_model("llama", seed=5)
    ids = torch.arange(3, 13).unsqueeze(0)
    options = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)

    def tokens(policy: str) -> torch.Tensor:
        with epikv_cli.attach(model, budget=30, policy=policy) as cache:
            out = model.generate(ids, cache=cache, **options)
            assert cache.evicted_total > 0
            return out

    plain = {policy: tokens(policy) for policy in ("streaming", "epikv")}
    compile_forward(model)
    for policy in ("streaming", "epikv"):
        assert torch.equal(tokens(policy), plain[policy]), policy


@pytest.mark.long
def test_a_compiled_forward_compiles_as_often_for_a_long_generation_as_for_a_short_one():
    """The cache's and the attention taps' bookkeeping (slot table, query ring index) stay outside the
    compiled graph: were they traced, their Python state would be guarded on and every step would
    recompile (until dynamo's recompile limit, after which the forward runs uncompiled). So after a
    40-token generation (the cache grows from 10 to 30 entries, then evicts), a 60-token one on the same
    compiled forward compiles no frame more."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import epikv_cli
    from epikv_cli.models.loading import compile_forward

    from conftest import tiny_model

    ids = torch.arange(3, 13).unsqueeze(0)
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", seed=5)
    compile_forward(model)
    compiled = {}
    try:
        for new_tokens in (40, 60):
            with epikv_cli.attach(model, budget=30, policy="epikv2") as cache:
                model.generate(
                    ids, cache=cache, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
                )
                assert cache.evicted_total > 0
            assert not [reason for reason in counters["unimplemented"] if "recompile limit" in reason]
            compiled[new_tokens] = counters["frames"]["total"]
    finally:
        torch._dynamo.reset()
    assert compiled[40] == compiled[60]


@pytest.mark.long
def test_compiled_forward_gives_the_same_greedy_tokens(tiny_model_dir):
    """--compile: torch.compile around the forward, eviction outside it; identical greedy tokens (CPU here)."""
    import json

    from typer.testing import CliRunner

    from epikv_cli.cli.app import app

    args = ["generate", "--model", str(tiny_model_dir), "-n", "60", "-b", "30", "--ignore-eos", "--json", "hello"]
    plain = json.loads(CliRunner().invoke(app, args).stdout)
    compiled = CliRunner().invoke(app, [*args, "--compile"])
    assert compiled.exit_code == 0, compiled.stderr
    data = json.loads(compiled.stdout)
    assert data["text"] == plain["text"] and data["evicted"] == plain["evicted"] > 0
