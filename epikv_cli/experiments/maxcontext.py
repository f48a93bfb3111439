"""The longest prompt each set-up can prefill within a memory limit (``epikv profile --max-context``).

Each policy runs in the set-up it needs: attention-based eviction the way the EpiKV authors ran it
(eager attention, every layer's weights returned), attention-free eviction on SDPA (or flash) with
hidden-state taps; ``POLICY@KERNEL`` overrides. Lengths are found by doubling, then bisection. Every
probe runs in a worker process whose allocations are capped at the limit (CUDA: the allocator's
memory fraction; CPU: the address space), so running out of memory fails that probe and never the
parent. On a CPU every probe gets a fresh worker: the heap a prefill leaves behind (freed, but kept
by the C allocator) would otherwise count against the next, longer probe, and the answer would
depend on the order of the probes. On CUDA the allocator's peak is per probe and the cache is
emptied between probes, so one worker serves the search, replaced only when it dies or a probe fails.

A worker (``python -m epikv_cli.experiments.maxcontext FD``) reads its set-up and then one length per line
on stdin, and answers one JSON line each on the pipe FD; its own stdout and stderr go to /dev/null, so
nothing a library prints there can be taken for an answer.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from epikv_cli.config import CacheSettings, ModelSettings, SamplingSettings
from epikv_cli.errors import UsageError
from epikv_cli.experiments.profile import attention_kernel, prompt_ids
from epikv_cli.models.loading import load, runs_on_cuda
from epikv_cli.policies.registry import POLICIES, evicts, make_policy
from epikv_cli.runtime.generation import Generation
from epikv_cli.runtime.stream import input_device

#: The module a probe worker runs (``python -m``): this one.
WORKER_MODULE = "epikv_cli.experiments.maxcontext"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
START_TOKENS = 512
MAX_TOKENS = 1 << 20
#: Bisection stops when the bracket is this tight (tokens, or this share of the length).
RESOLUTION_TOKENS = 64
RESOLUTION_SHARE = 1 / 32


def parse_memory(text: str) -> int:
    """``16GiB``, ``16G`` (binary), ``16GB`` (decimal), ``1500MiB`` or plain bytes -> bytes."""
    match = _SIZE.match(text or "")
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"--memory-limit {text!r} is not a size; write it like 16GiB, 1500MiB or 8G")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    power = "KMGT".index(unit) + 1 if unit else 0
    base = 1000 if (unit and not binary and text.strip().upper().endswith("B")) else 1024
    return int(number * base**power)


def available_memory(cuda: bool) -> int:
    """Bytes this machine can give a new process now: free GPU memory, or MemAvailable."""
    if cuda:
        return torch.cuda.mem_get_info()[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class ProbeResult:
    length: int
    ok: bool
    peak_memory_bytes: int = 0
    error: str | None = None


@dataclass
class MaxContext:
    """One set-up's answer; ``reached_model_limit`` when even the model's context length fits."""

    policy: str
    kernel: str
    max_prompt_tokens: int
    peak_memory_bytes: int
    reached_model_limit: bool
    probes: list[dict]


class ProbeWorker:
    """A child process that loads the model and prefills prompts of the lengths it is sent.

    Args:
        setup: what the child loads (model settings, policy and its options, kernel, limit).
        reuse: keep the process for the next probe after a success (CUDA); else each probe starts one.
    """

    def __init__(self, setup: dict, reuse: bool = False) -> None:
        self.setup = setup
        self.reuse = reuse
        self.process: subprocess.Popen | None = None
        self.replies = None  # the reading end of the worker's answers
        self.attn: str | None = None  # the kernel the worker's model loaded with
        self.max_positions = MAX_TOKENS  # the model's own context length, the search's ceiling

    def start(self) -> None:
        read_end, write_end = os.pipe()  # the worker's answers: a pipe of their own, not its stdout
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(write_end)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
                pass_fds=(write_end,),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the worker holds the only writing end: its death ends the answers
        self.replies = os.fdopen(read_end, "r", encoding="utf-8")
        self._send(self.setup)
        ready = self.replies.readline()
        if not ready:
            self.close()
            raise UsageError("the probe process could not load the model within the memory limit; raise --memory-limit")
        reply = json.loads(ready)
        if "error" in reply:
            self.close()
            raise UsageError(f"the probe process could not start: {reply['error']}")
        self.attn = reply["attn"]
        self.max_positions = reply["max_positions"] or MAX_TOKENS

    def _send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def probe(self, length: int) -> ProbeResult:
        if self.process is None or self.process.poll() is not None:
            self.start()
        try:
            self._send({"length": length})
            line = self.replies.readline()
        except BrokenPipeError:
            line = ""
        if not line:  # killed (out of memory beyond the cap): that length does not fit
            self.close()
            return ProbeResult(length, False, error="the probe process died")
        result = ProbeResult(**json.loads(line))
        if not (result.ok and self.reuse):
            # A prefill leaves the worker's heap high (the allocator keeps what it freed), so the next
            # probe would start above its own baseline: it gets a fresh process.
            self.close()
        return result

    def close(self) -> None:
        if self.process is not None:
            with suppress(BrokenPipeError):
                self.process.stdin.close()  # the worker's loop ends, and the worker with it
            self.process.wait(timeout=60)
        if self.replies is not None:
            self.replies.close()
        self.process = None
        self.replies = None


def search(probe, start: int = START_TOKENS, ceiling: int = MAX_TOKENS) -> tuple[int, list[ProbeResult]]:
    """Longest length ``probe`` accepts: doubling from ``start``, then bisection. Returns (length, probes).

    Doubling stops at ``ceiling`` (the model's context length). If ``start`` already fails, lengths
    halve until one fits. The answer is within ``max(64 tokens, 1/32)`` of the true limit, on the
    safe side.
    """
    probes: list[ProbeResult] = []

    def fits(length: int) -> bool:
        probes.append(probe(length))
        return probes[-1].ok

    low, length = 0, min(start, ceiling)  # low: the longest length known to fit
    while fits(length):
        low = length
        if low >= ceiling:
            return low, probes
        length = min(length * 2, ceiling)
    high = length  # the shortest length known not to fit
    while low == 0:
        length = high // 2
        if length < 1:
            return 0, probes
        if fits(length):
            low = length
        else:
            high = length
    while high - low > max(RESOLUTION_TOKENS, int(low * RESOLUTION_SHARE)):
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, probes


# -- the worker side --------------------------------------------------------------------------------
def _cap_memory(limit: int, cuda: bool) -> None:
    """Make allocations beyond ``limit`` fail in this process instead of waking the OOM killer."""
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), 0)
        return
    status = Path("/proc/self/status").read_text()
    virtual = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
    resident = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
    headroom = max(limit - resident, 0) + (1 << 30)  # address space is reserved beyond what is touched
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (virtual + headroom, hard))


def _prefill(loaded, ids, cache, kernel: str | None, limit: int) -> ProbeResult:
    """One prefill of ``ids``: does its peak memory stay within ``limit``?"""

    length = ids.shape[1]
    try:
        with attention_kernel(loaded.model, kernel):
            generation = Generation(
                loaded.model, loaded.tokenizer, ids, cache, SamplingSettings(max_new_tokens=1, ignore_eos=True)
            )
            for _ in generation:
                pass
        peak = generation.result.prefill_peak_memory_bytes
        return ProbeResult(length, peak <= limit, peak)
    except (MemoryError, RuntimeError) as error:  # torch.OutOfMemoryError and CPU allocator failures
        return ProbeResult(length, False, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")


def probe_cache(setup: dict, length: int) -> CacheSettings:
    """The cache a probe of ``length`` tokens prefills into: no budget for a policy that does not evict, else one
    that holds the whole prompt and what the policy's options keep beside it (``epikv2:prompt=keep`` asks for about
    four times the prompt), so that the policy accepts every length the search tries (a refused budget ended the
    worker, and the probe counted as out of memory)."""
    policy, options = setup["policy"], tuple((key, value) for key, value in setup.get("options", ()))
    if not evicts(policy):
        return CacheSettings(budget=None, policy=policy, options=options)
    budget = 2 * length + 256
    floor = make_policy(CacheSettings(budget=budget, policy=policy, options=options)).budget_floor(length).tokens
    return CacheSettings(budget=max(budget, floor), policy=policy, options=options)


def _worker(reply_fd: int) -> None:  # pragma: no cover - runs in the child process (tested through run_max_context)
    """Load the model named by the first line of stdin, then answer each length that follows with one
    :class:`ProbeResult` line on ``reply_fd``."""
    with os.fdopen(reply_fd, "w", encoding="utf-8") as replies:

        def reply(message: dict) -> None:
            replies.write(json.dumps(message) + "\n")
            replies.flush()

        setup = json.loads(sys.stdin.readline())
        try:
            loaded = load(ModelSettings(**setup["model"]))
            cuda = input_device(loaded.model).type == "cuda"
            _cap_memory(setup["limit"], cuda)
        except Exception as error:  # noqa: BLE001 - reported to the parent as one line
            reply({"error": str(error).splitlines()[0][:300]})
            return
        text_config = loaded.model.config.get_text_config(decoder=True)
        reply({"attn": loaded.attn, "max_positions": getattr(text_config, "max_position_embeddings", None)})
        for line in sys.stdin:
            length = json.loads(line)["length"]
            ids = prompt_ids(loaded.tokenizer, length)
            cache = probe_cache(setup, length)
            result = _prefill(loaded, ids, cache, setup["kernel"], setup["limit"])
            if cuda:
                torch.cuda.empty_cache()
            reply(asdict(result))


def default_kernel(policy: str, kernel: str | None) -> str | None:
    """The set-up a policy needs when none is named: the authors' eager attention for attention-based
    eviction (weights returned), the model's own kernel otherwise."""

    if kernel is not None:
        return kernel
    needs = POLICIES[policy].attention_needs
    return "eager" if needs is not None and needs.weights else None


def run_max_context(model_settings, runs, limit: int, progress=lambda text: None) -> list[MaxContext]:
    """For each policy run, the longest prompt that prefills within ``limit`` bytes."""

    cuda = runs_on_cuda(model_settings.device_map)
    available = available_memory(cuda)
    if limit > available:
        raise UsageError(
            f"--memory-limit {limit / 2**30:.1f} GiB is more than this machine has available now "
            f"({available / 2**30:.1f} GiB); give a smaller limit"
        )
    for run in runs:  # a policy's options checked before any worker starts
        make_policy(
            CacheSettings(budget=START_TOKENS if evicts(run.policy) else None, policy=run.policy, options=run.options)
        )
    results = []
    for run in runs:
        kernel = default_kernel(run.policy, run.kernel)
        setup = {"model": asdict(model_settings), "policy": run.policy, "kernel": kernel, "limit": limit}
        setup["options"] = [list(pair) for pair in run.options]
        worker = ProbeWorker(setup, reuse=cuda)

        def probe(length: int, worker=worker, run=run) -> ProbeResult:
            progress(f"{run.label}: prefill {length} tokens")
            return worker.probe(length)

        try:
            worker.start()
            ceiling = worker.max_positions
            length, probes = search(probe, ceiling=ceiling)
        finally:
            worker.close()
        peak = max((p.peak_memory_bytes for p in probes if p.ok and p.length == length), default=0)
        results.append(
            MaxContext(
                run.spec or run.policy,
                kernel or worker.attn,
                length,
                peak,
                length >= ceiling,
                [asdict(p) for p in probes],
            )
        )
    return results


if __name__ == "__main__":  # pragma: no cover
    _worker(int(sys.argv[1]))
