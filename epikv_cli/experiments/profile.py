"""Speed and memory of several policies on one model, compared fairly (``epikv profile``).

One model is loaded once. After a warm-up round, the policies run interleaved (A B C A B C ...) so
that a noisy machine affects them alike; every run is forced to the same number of new tokens (EOS
ignored) from the same prompt of real text. A policy may name the attention kernel it runs on,
``h2o@eager`` being the EpiKV authors' set-up for attention-based eviction.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from epikv_cli.config import ATTN_CHOICES, MAX_TOKENS, CacheSettings, SamplingSettings, list_items
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.memory import peak_memory, reset_peak
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Policy
from epikv_cli.policies.registry import (
    POLICIES,
    check_settings,
    evicts,
    make_policy,
    parse_policy_spec,
)
from epikv_cli.runtime.batched import BatchDecoder
from epikv_cli.runtime.generation import Generation
from epikv_cli.runtime.stream import context_length, input_device

MIN_NEW_TOKENS = 8
WARMUP_TOKENS = 8
#: Kernels a policy may name after ``@``.
KERNELS = tuple(kernel for kernel in ATTN_CHOICES if kernel != "auto")
EMPTY_POLICIES = "--policies is empty; give names such as full,streaming,epikv"


@dataclass(frozen=True)
class PolicyRun:
    """One entry of ``--policies``: a policy spec (``epikv2:period=32``) and, optionally, the kernel it
    runs on (``h2o@eager``)."""

    policy: str
    kernel: str | None = None
    options: tuple[tuple[str, str], ...] = ()
    spec: str = ""

    @property
    def label(self) -> str:
        name = self.spec or self.policy
        return f"{name}@{self.kernel}" if self.kernel else name

    @classmethod
    def parse(cls, text: str) -> PolicyRun:
        spec, _, kernel = text.strip().partition("@")
        policy, options = parse_policy_spec(spec)
        if kernel and kernel not in KERNELS:
            raise UsageError(
                f"--policies: unknown kernel {kernel!r} in {text.strip()!r}; use one of {', '.join(KERNELS)}"
            )
        return cls(policy, kernel or None, options, spec.strip())


@dataclass(frozen=True)
class ProfileSettings:
    """What ``epikv profile`` compares."""

    runs: tuple[PolicyRun, ...]
    budget: int
    prompt_tokens: int = 256
    new_tokens: int = 512
    repeats: int = 3
    batch_size: int = 1

    def __post_init__(self) -> None:
        if not self.runs:
            raise UsageError(EMPTY_POLICIES)
        labels = [run.label for run in self.runs]
        if len(set(labels)) != len(labels):
            raise UsageError(f"--policies lists a policy twice: {','.join(labels)}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.repeats < 1:
            raise UsageError(f"--repeats must be at least 1, got {self.repeats}")
        if self.new_tokens < MIN_NEW_TOKENS:
            raise UsageError(
                f"--new-tokens must be at least {MIN_NEW_TOKENS} (flatness compares quarters), got {self.new_tokens}"
            )
        if self.prompt_tokens < 1:
            raise UsageError(f"--prompt-tokens must be at least 1, got {self.prompt_tokens}")
        if self.prompt_tokens > MAX_TOKENS or self.new_tokens > MAX_TOKENS:
            raise UsageError(
                f"--prompt-tokens and --new-tokens must be at most {MAX_TOKENS}, got {self.prompt_tokens} and "
                f"{self.new_tokens}"
            )
        if self.budget < 1:
            raise UsageError(f"--budget must be a positive number of tokens, got {self.budget}")
        for run in self.runs:  # each policy's options, before any model loads
            self.cache_for(run)

    @classmethod
    def parse_policies(cls, text: str) -> tuple[PolicyRun, ...]:
        """The runs of ``--policies``; an empty list is refused (an empty ``--policies ''`` is not the default)."""
        runs = tuple(PolicyRun.parse(part) for part in list_items(text, "--policies"))
        if not runs:
            raise UsageError(EMPTY_POLICIES)
        return runs

    def cache_for(self, run: PolicyRun) -> CacheSettings:
        return check_settings(
            CacheSettings(budget=self.budget if evicts(run.policy) else None, policy=run.policy, options=run.options)
        )

    def check_context(self, model) -> None:
        """The prompt and the new tokens must fit the model's context (profiling positions it was never trained on
        measures nothing a user would run, and a huge prompt only fails to allocate)."""
        limit = context_length(model)
        if limit is not None and self.prompt_tokens + self.new_tokens > limit:
            raise UsageError(
                f"--prompt-tokens {self.prompt_tokens} and --new-tokens {self.new_tokens} go beyond the model's "
                f"context of {limit} tokens (max_position_embeddings); give --prompt-tokens "
                f"{max(1, limit - self.new_tokens)} or fewer"
            )

    def evicting(self) -> Iterator[tuple[CacheSettings, Policy]]:
        """Each evicting run's cache settings and a policy made from them (for checks before anything runs)."""
        for run in self.runs:
            if POLICIES[run.policy].evicts:
                cache = self.cache_for(run)
                yield cache, make_policy(cache)

    def check_budgets(self) -> None:
        """Every policy must accept this budget for this prompt, before anything runs."""
        for _, policy in self.evicting():
            policy.check_budget(self.prompt_tokens, self.budget)


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as Linux reports it (``platform.processor()`` or the architecture elsewhere)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str | torch.device) -> dict:
    """What a profile ran on, as llama-bench records it beside its figures: the CPU, the instruction set torch's CPU
    kernels use (``AVX2``, ``AVX512``...: on an AVX2 CPU bfloat16 can run slower than float32), torch's threads in
    this process, the GPU on CUDA, and torch's version."""
    device = torch.device(device)
    return {
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
    }


def prompt_ids(tokenizer, tokens: int, prompt_file: Path | None = None) -> torch.Tensor:
    """``[1, tokens]``: the passage (bundled, or ``prompt_file``) tokenized and repeated to length."""
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read --prompt-file {prompt_file}: {error}") from None
    else:
        text = resources.files("epikv_cli").joinpath("data/passage.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text.strip() else []
    if not ids:  # nothing, or blank lines only: a prompt of newlines measures nothing a user runs
        raise UsageError(f"--prompt-file {prompt_file} holds no text")
    repeated = (ids * (tokens // len(ids) + 1))[:tokens]
    return torch.tensor([repeated])


@dataclass
class RunMeasure:
    """What one generation measured."""

    prefill_seconds: float
    decode_tokens_per_s: float
    flatness: float
    prefill_peak_memory_bytes: int
    decode_peak_memory_bytes: int
    kv_cache_bytes: int
    peak_stored: int
    peak_memory_kind: str


def flatness(elapsed: list[float]) -> float:
    """Decode tokens/s over the last quarter of the tokens divided by that over the first quarter.

    ``elapsed[i]`` is when token i was produced (token 0 comes out of the prefill).
    """
    quarter = (len(elapsed) - 1) // 4
    first = quarter / (elapsed[quarter] - elapsed[0])
    last = quarter / (elapsed[-1] - elapsed[-1 - quarter])
    return last / first


@contextmanager
def attention_kernel(model, kernel: str | None):
    """Run ``model`` on ``kernel`` for a while (``None``: as loaded)."""
    base = model.config._attn_implementation
    if kernel is None or kernel == base:
        yield
        return
    model.set_attn_implementation(kernel)
    try:
        yield
    finally:
        model.set_attn_implementation(base)


def measure(
    model, tokenizer, ids: torch.Tensor, run: PolicyRun, cache: CacheSettings, new_tokens: int, batch_size: int = 1
) -> RunMeasure:
    """One forced-length generation (EOS ignored); ``batch_size`` > 1 decodes that many copies together."""
    with attention_kernel(model, run.kernel):
        if batch_size > 1:
            return measure_batch(model, ids, cache, new_tokens, batch_size)
        generation = Generation(
            model, tokenizer, ids, cache, SamplingSettings(max_new_tokens=new_tokens, ignore_eos=True)
        )
        elapsed = [event.elapsed for event in generation]
    result = generation.result
    return RunMeasure(
        prefill_seconds=result.prefill_seconds,
        decode_tokens_per_s=result.decode_tokens_per_s,
        flatness=flatness(elapsed),
        prefill_peak_memory_bytes=result.prefill_peak_memory_bytes,
        decode_peak_memory_bytes=result.decode_peak_memory_bytes,
        kv_cache_bytes=result.kv_cache_bytes,
        peak_stored=result.peak_stored,
        peak_memory_kind=result.peak_memory_kind,
    )


def measure_batch(model, ids: torch.Tensor, cache: CacheSettings, new_tokens: int, batch_size: int) -> RunMeasure:
    """``batch_size`` copies of ``ids`` ``[1, n]``, each prefilled alone, then decoded together for ``new_tokens``
    greedy tokens (EOS ignored), one forward per step for the whole batch. Decode tokens/s counts every row's
    tokens (the batch's throughput); prefill seconds and memory cover all the prefills; the KV bytes are what
    the batch's buffers hold (every row's slots, padding and room to grow included)."""
    device = input_device(model)
    ids = ids.to(device)
    gc.collect()  # an earlier run's cache sits in a reference cycle until collected (Generation does this itself)
    reset_peak(device)
    start = time.perf_counter()
    with BatchDecoder(model, [cache]) as decoder:
        with torch.inference_mode():
            logits = torch.stack([decoder.add(ids, cache, ids.shape[1] + new_tokens) for _ in range(batch_size)])
            tokens = logits.argmax(dim=-1)
            host_copies([tokens])  # the prefill's last kernels have run
            prefill_memory = peak_memory(device)[0]
            reset_peak(device)  # (its heap trim is the prefill's time, as in Generation: not the decode's)
            prefill_seconds = time.perf_counter() - start
            elapsed = [prefill_seconds]
            for _ in range(new_tokens - 1):
                logits = decoder.forward(tokens)
                tokens = logits.argmax(dim=-1)
                values = host_copies([tokens] + decoder.pending_reads)  # the step's one host synchronisation
                decoder.settle(values[1:])
                elapsed.append(time.perf_counter() - start)
        decode_memory, kind = peak_memory(device)
        rows = [decoder.row(index) for index in range(decoder.batch)]
        kv_bytes = decoder.cache.nbytes()
    decode_seconds = elapsed[-1] - elapsed[0]
    return RunMeasure(
        prefill_seconds=prefill_seconds,
        decode_tokens_per_s=batch_size * (new_tokens - 1) / decode_seconds,
        flatness=flatness(elapsed),
        prefill_peak_memory_bytes=prefill_memory,
        decode_peak_memory_bytes=decode_memory,
        kv_cache_bytes=kv_bytes,
        peak_stored=max(row.peak_stored for row in rows),
        peak_memory_kind=kind,
    )


@dataclass
class PolicyReport:
    """Medians over the repeats, with the decode speed's spread and ratios to the first policy."""

    policy: str
    prefill_seconds: float
    decode_tokens_per_s: float
    decode_tokens_per_s_min: float
    decode_tokens_per_s_max: float
    flatness: float
    prefill_peak_memory_bytes: int
    decode_peak_memory_bytes: int
    kv_cache_bytes: int
    peak_stored: int
    peak_memory_kind: str
    #: to the first policy's; None where the first's figure is 0 (JSON has no NaN)
    ratio_decode_tokens_per_s: float | None = 1.0
    ratio_prefill_seconds: float | None = 1.0
    ratio_kv_cache_bytes: float | None = 1.0
    ratio_decode_peak_memory_bytes: float | None = 1.0
    #: how many measured runs the medians are over (fewer than --repeats after Ctrl-C)
    runs: int = 0

    @classmethod
    def from_runs(cls, label: str, runs: list[RunMeasure]) -> PolicyReport:
        speeds = [r.decode_tokens_per_s for r in runs]
        return cls(
            runs=len(runs),
            policy=label,
            prefill_seconds=round(statistics.median(r.prefill_seconds for r in runs), 6),
            decode_tokens_per_s=round(statistics.median(speeds), 3),
            decode_tokens_per_s_min=round(min(speeds), 3),
            decode_tokens_per_s_max=round(max(speeds), 3),
            flatness=round(statistics.median(r.flatness for r in runs), 4),
            prefill_peak_memory_bytes=int(statistics.median(r.prefill_peak_memory_bytes for r in runs)),
            decode_peak_memory_bytes=int(statistics.median(r.decode_peak_memory_bytes for r in runs)),
            kv_cache_bytes=max(r.kv_cache_bytes for r in runs),
            peak_stored=max(r.peak_stored for r in runs),
            peak_memory_kind=runs[0].peak_memory_kind,
        )

    def relative_to(self, first: PolicyReport) -> None:
        def ratio(mine: float, theirs: float) -> float | None:
            return round(mine / theirs, 4) if theirs else None

        self.ratio_decode_tokens_per_s = ratio(self.decode_tokens_per_s, first.decode_tokens_per_s)
        self.ratio_prefill_seconds = ratio(self.prefill_seconds, first.prefill_seconds)
        self.ratio_kv_cache_bytes = ratio(self.kv_cache_bytes, first.kv_cache_bytes)
        self.ratio_decode_peak_memory_bytes = ratio(self.decode_peak_memory_bytes, first.decode_peak_memory_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def run_profile(
    model,
    tokenizer,
    settings: ProfileSettings,
    ids: torch.Tensor,
    advance=lambda label: None,
    measured: dict[str, list[RunMeasure]] | None = None,
    measurer=None,
) -> list[PolicyReport]:
    """Warm up, then run every policy ``repeats`` times interleaved; ``advance(label)`` after each run.
    ``measured`` (label -> runs) gathers the runs as they finish, for a caller that is interrupted
    (:func:`reports_of`). ``measurer(run, cache, new_tokens)`` measures one run (default: the transformers
    engine's :func:`measure` on ``model``; the vLLM engine passes its own, :func:`measure_vllm`)."""
    settings.check_budgets()
    if measurer is None:

        def measurer(run: PolicyRun, cache: CacheSettings, new_tokens: int) -> RunMeasure:
            return measure(model, tokenizer, ids, run, cache, new_tokens, settings.batch_size)

    for run in settings.runs:  # warm-up round: first-call costs (kernels, caches, taps) stay out of the numbers
        measurer(run, settings.cache_for(run), min(WARMUP_TOKENS, settings.new_tokens))
        advance(f"warm-up {run.label}")
    measured = measured if measured is not None else {}
    measured.update({run.label: [] for run in settings.runs})
    for _ in range(settings.repeats):
        for run in settings.runs:
            measured[run.label].append(measurer(run, settings.cache_for(run), settings.new_tokens))
            advance(run.label)
    return reports_of(measured)


def measure_vllm(llm, ids: torch.Tensor, cache: CacheSettings, new_tokens: int, batch_size: int) -> RunMeasure:
    """``batch_size`` copies of ``ids`` ``[1, n]`` submitted together to ``llm`` (a vLLM engine for ``cache``, built
    with ``report=True``) for ``new_tokens`` greedy tokens each (EOS ignored); vLLM schedules them. Prefill seconds:
    until every request has its first token; decode tokens/s: the tokens generated after that, over the time after
    that (a request whose first token came steps earlier had made more by then: those are not counted); KV bytes:
    the pages vLLM allocated to the batch's requests (one ring of K + 1 slots per layer each)."""
    from vllm import SamplingParams  # noqa: PLC0415 (vllm: only for --engine vllm)
    from vllm.inputs import TokensPrompt  # noqa: PLC0415 (vllm: ditto)

    from epikv_cli.vllm.engine import request_bytes, ring_of  # noqa: PLC0415 (vllm: ditto)

    engine = llm.llm_engine
    prompt = ids[0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    device = torch.device("cpu")
    gc.collect()
    reset_peak(device)
    start = time.perf_counter()
    names = [f"profile-{time.monotonic_ns()}-{row}" for row in range(batch_size)]
    for name in names:
        engine.add_request(name, TokensPrompt(prompt_token_ids=prompt), params)
    first: dict[str, float] = {}
    made: dict[str, int] = {}  # tokens per request so far (the outputs are cumulative, vLLM's default)
    elapsed: list[float] = []
    prefill_memory = made_by_then = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            made[output.request_id] = len(output.outputs[0].token_ids)
            if made[output.request_id] and output.request_id not in first:
                first[output.request_id] = now
        if len(first) == batch_size:
            if not elapsed:
                prefill_memory = peak_memory(device)[0]
                reset_peak(device)
                made_by_then = sum(made.values())
            elapsed.append(now)
    decode_memory, kind = peak_memory(device)
    ring = ring_of(llm) if evicts(cache.policy) else None
    rings = ring.holding(prompt) if ring is not None else []
    if ring is not None:
        kv_bytes = ring.request_bytes()
    else:  # stock vLLM: the 128-token blocks of the whole sequence
        config = llm.llm_engine.vllm_config.model_config
        dtype = str(config.dtype).removeprefix("torch.")
        kv_bytes = request_bytes(config.model, cache, len(prompt) + new_tokens, dtype)
    decode_seconds = elapsed[-1] - elapsed[0]
    return RunMeasure(
        prefill_seconds=max(first.values()) - start,
        decode_tokens_per_s=(sum(made.values()) - made_by_then) / decode_seconds,
        flatness=flatness(elapsed),
        prefill_peak_memory_bytes=prefill_memory,
        decode_peak_memory_bytes=decode_memory,
        kv_cache_bytes=kv_bytes * batch_size,
        peak_stored=max((request.peak_stored for request in rings if request is not None), default=0),
        peak_memory_kind=kind,
    )


def reports_of(measured: dict[str, list[RunMeasure]]) -> list[PolicyReport]:
    """One report per policy with at least one finished run (medians over them), ratios to the first."""
    reports = [PolicyReport.from_runs(label, runs) for label, runs in measured.items() if runs]
    for report in reports:
        report.relative_to(reports[0])
    return reports
