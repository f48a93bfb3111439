"""Resolve ``--model``, load model and tokenizer through Accelerate, choose the attention kernel."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from epikv_cli.config import ATTN_CHOICES, ModelSettings
from epikv_cli.errors import ModelLoadError, UsageError
from epikv_cli.models.calibration import load_calibration, model_key
from epikv_cli.models.demo import ensure_demo_model
from epikv_cli.models.shapes import cut_layers, random_model, shape_config

#: Architectures whose attention needs eager (soft-capping that SDPA kernels do not implement).
EAGER_ONLY = frozenset({"gemma2"})
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: ``kind`` is ``dir``, ``gguf``, ``hub``, ``config`` (a config.json: random
    weights) or ``shape`` (a known shape by name: random weights); ``location`` the path, id or name."""

    kind: str
    location: str
    gguf_file: str | None = None

    @property
    def root(self) -> str:
        return str(Path(self.location).parent) if self.kind == "gguf" else self.location


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    attn: str


def resolve_source(spec: str | None, log=None) -> ModelSource:
    """Turn ``--model`` into a :class:`ModelSource`; ``None`` fetches the demo model if needed."""
    if spec is None:
        return ModelSource("dir", str(ensure_demo_model(log) if log else ensure_demo_model()))
    path = Path(spec).expanduser()
    if spec.endswith(".json"):
        if not path.is_file():
            raise UsageError(f"config file not found: {spec}; give an existing config.json")
        return ModelSource("config", str(path))
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise UsageError(f"model file not found: {spec}; give an existing .gguf file")
        return ModelSource("gguf", str(path), gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UsageError(f"{spec} has no config.json; give a directory saved with save_pretrained")
        return ModelSource("dir", str(path))
    if path.exists():
        raise UsageError(f"{spec} is neither a model directory nor a .gguf file")
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or os.sep != "/" and os.sep in spec
    if looks_like_path or not _HUB_ID.match(spec):
        raise UsageError(
            f"model path not found: {spec}; give an existing directory, a .gguf file, or a Hub id (org/name)"
        )
    return ModelSource("hub", spec)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose_attn(
    requested: str, *, on_cuda: bool, flash_available: bool, model_type: str, dtype: torch.dtype | None
) -> str:
    """The attention implementation to load with.

    ``auto``: eager for architectures that need it, flash_attention_2 when flash-attn is installed and
    the model runs on CUDA in half precision, otherwise sdpa (which itself dispatches to flash kernels on CUDA).
    """
    if requested not in ATTN_CHOICES:
        raise UsageError(f"--attn must be one of {', '.join(ATTN_CHOICES)}, got {requested!r}")
    if requested == "flash_attention_2" and not (flash_available and on_cuda):
        raise UsageError(
            "--attn flash_attention_2 needs a CUDA GPU and the flash-attn package (pip install 'epikv[flash]'); "
            "use --attn sdpa"
        )
    if requested != "auto":
        return requested
    if model_type in EAGER_ONLY:
        return "eager"
    if on_cuda and flash_available and dtype in (torch.float16, torch.bfloat16):
        return "flash_attention_2"
    return "sdpa"


def runs_on_cuda(device_map: str) -> bool:
    return torch.cuda.is_available() and not device_map.startswith(("cpu", "mps", "disk"))


def _torch_dtype(name: str, source: ModelSource):
    """The ``dtype`` for ``from_pretrained``: named, or the checkpoint's own (``"auto"``)."""
    if name != "auto":
        return getattr(torch, name)
    if source.kind == "gguf":  # GGUF weights are de-quantised; float32 keeps them exact
        return torch.float32
    return "auto"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def byte_tokenizer(chat_template: str | None = None, specials: tuple[str, ...] = ("<s>", "</s>")):
    """A tokenizer with one token per byte (ids 0-255, then ``specials``): for models without one of their own."""

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(sorted(alphabet))}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=specials[0], eos_token=specials[1])
    if specials[2:]:
        tokenizer.add_special_tokens({"additional_special_tokens": list(specials[2:])})
    tokenizer.chat_template = chat_template
    return tokenizer


def _random_model(source: ModelSource, settings: ModelSettings) -> LoadedModel:
    """A model with random weights from a known shape or a config.json (speed and memory runs)."""

    if source.kind == "shape":
        config = shape_config(source.location)
    else:
        try:
            config = AutoConfig.from_pretrained(source.location)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot read the config {source.location}: {_one_line(error)}") from None
    config = cut_layers(config, settings.layers)
    on_cuda = runs_on_cuda(settings.device_map)
    dtype = (
        getattr(torch, settings.dtype) if settings.dtype != "auto" else (torch.bfloat16 if on_cuda else torch.float32)
    )
    attn = choose_attn(
        settings.attn,
        on_cuda=on_cuda,
        flash_available=flash_attn_installed(),
        model_type=getattr(config, "model_type", ""),
        dtype=dtype,
    )
    config._attn_implementation = attn
    model = random_model(config, dtype, device="cuda" if on_cuda else "cpu")
    tokenizer = None
    if source.kind == "config":
        try:
            tokenizer = AutoTokenizer.from_pretrained(Path(source.location).parent)
        except (OSError, ValueError, TypeError):
            tokenizer = None
    return LoadedModel(model, tokenizer or byte_tokenizer(), source, attn)


def native_bfloat16() -> bool:
    """Whether oneDNN runs bfloat16 natively on this CPU (its own test: AVX-512 or newer on x86). Without it bfloat16
    is the slower dtype: on an AVX2 machine a 49152 x 576 product of 8 rows took 57 ms against 33 in float32
    (docs/results.md). True where torch cannot tell."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


#: Said (as status, which ``-q`` silences) when a model runs in bfloat16 on a CPU without :func:`native_bfloat16`.
SLOW_BFLOAT16 = (
    "this CPU ({capability}) has no bfloat16 instructions, so bfloat16 is usually slower here than --dtype float32"
)


def load(settings: ModelSettings, log=None) -> LoadedModel:
    """Load model and tokenizer as ``settings`` say; errors become :class:`ModelLoadError` or :class:`UsageError`."""
    loaded = _load(settings, log)
    first = next(loaded.model.parameters())
    if log is not None and first.dtype == torch.bfloat16 and first.device.type == "cpu" and not native_bfloat16():
        log(SLOW_BFLOAT16.format(capability=torch.backends.cpu.get_cpu_capability()))
    if settings.compile:
        compile_forward(loaded.model)
    return loaded


def compile_forward(model) -> None:
    """``torch.compile`` the forward: the session's hooks (eviction, scores) run around it, outside the
    compiled graph. On CUDA with ``reduce-overhead`` (CUDA graphs): once a budgeted cache is full every
    decode step has the same shapes, K + 1 entries, and replays one captured graph."""
    mode = "reduce-overhead" if next(model.parameters()).is_cuda else None
    # Sessions add and remove hooks on the decoder blocks (hidden-state taps) after the first compile: guard on
    # them, so that a changed set recompiles instead of running the graph traced with the old ones
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    model.forward = torch.compile(model.forward, mode=mode)


@contextmanager
def _quiet_gguf_conversion(active: bool):
    """While loading a GGUF file: no de-quantisation progress bar (transformers draws it with tqdm directly,
    outside its own progress-bar switch), so that loading is as quiet as from safetensors."""
    if not active:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # noqa: PLC0415 (gguf: only when a .gguf file is loaded)

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _load(settings: ModelSettings, log=None) -> LoadedModel:

    if settings.shape is not None:
        return _random_model(ModelSource("shape", settings.shape), settings)
    source = resolve_source(settings.model, log)
    if source.kind == "config":
        return _random_model(source, settings)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    with _quiet_gguf_conversion(source.kind == "gguf"):
        try:
            try:
                config = AutoConfig.from_pretrained(source.root, **kwargs)
                tokenizer = AutoTokenizer.from_pretrained(source.root, **kwargs)
            except (OSError, ValueError) as error:
                if source.kind == "hub":
                    raise ModelLoadError(
                        f"could not get {source.location!r} from the Hugging Face Hub ({_one_line(error)}); "
                        "check the id and the network, or pass a local directory or .gguf file"
                    ) from None
                raise ModelLoadError(f"cannot load {source.location}: {_one_line(error)}") from None
            on_cuda = runs_on_cuda(settings.device_map)
            dtype = _torch_dtype(settings.dtype, source)
            resolved_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(config, "dtype", None)
            if isinstance(resolved_dtype, str):
                resolved_dtype = getattr(torch, resolved_dtype, None)
            attn = choose_attn(
                settings.attn,
                on_cuda=on_cuda,
                flash_available=flash_attn_installed(),
                model_type=getattr(config, "model_type", ""),
                dtype=resolved_dtype,
            )
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    source.root, dtype=dtype, device_map=settings.device_map, attn_implementation=attn, **kwargs
                )
            except (OSError, ValueError, RuntimeError) as error:
                raise ModelLoadError(f"cannot load the weights of {source.location}: {_one_line(error)}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
    model.eval()
    model.epikv_calibration = load_calibration(model_key(source))  # EpiKV's bands for this model, if calibrated
    return LoadedModel(model, tokenizer, source, attn)
