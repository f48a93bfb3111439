"""``epikv serve``: vLLM's OpenAI-compatible server with epikv's plugin, answering on 127.0.0.1 under eviction."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from harness import transformers_reference

#: A 10-token prompt and 80 new tokens under K = 48: 42 entries leave each layer's ring.
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
BUDGET, NEW = 48, 80


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.load(answer)


def test_a_completion_request_is_answered_under_eviction(demo):
    """The server's greedy completion of a token-id prompt is the transformers engine's under the same policy and
    budget, token for token, while 42 entries leave each ring; a prompt longer than the ring, sent first, gets its
    own HTTP 400 saying so, and the server goes on."""
    port = free_port()
    command = [sys.executable, "-m", "epikv_cli", "serve", "--budget", str(BUDGET), "--policy", "epikv2", "--eager"]
    command += ["--port", str(port), "--max-model-len", "512", "--dtype", "float32"]
    # vLLM's own process layout, as a user's shell gives it: the API server and an engine-core process
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        reference = transformers_reference("epikv2", BUDGET, NEW, [PROMPT], demo)[0]
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as health:
                    if health.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 240 s"
                time.sleep(1)
        too_long = {"model": demo, "prompt": PROMPT * 6, "max_tokens": 4}  # 60 tokens: the ring holds 49
        try:
            refused = post(f"http://127.0.0.1:{port}/v1/completions", too_long)
        except urllib.error.HTTPError as error:
            refused = (error.code, json.load(error))
        answer = post(
            f"http://127.0.0.1:{port}/v1/completions",
            {
                "model": demo,
                "prompt": PROMPT,
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    assert refused[0] == 400, refused
    assert "the 60-token prompt does not fit --budget 48" in refused[1]["error"]["message"]
    choice = answer["choices"][0]
    assert answer["usage"]["completion_tokens"] == NEW
    assert choice["token_ids"] == reference["tokens"]
    assert sum(len(step) for step in reference["evicted"]) > 0  # positions no KV head holds any more
