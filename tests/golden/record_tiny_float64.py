"""Record the tiny models' golden cases in float64 with the code found first on ``sys.path``.

How ``tests/golden/outputs.json``'s tiny cases were recorded (the demo model's are the float32 recording of 5def55e),
with the code from before the restructure, whose own recorder loads the tiny models in float32::

    git worktree add /tmp/rec b68b429
    PYTHONPATH=/tmp/rec:/tmp/rec/tests .venv/bin/python tests/golden/record_tiny_float64.py tiny.json

then each case of ``tiny.json`` replaces the one of the same key. With ``PYTHONPATH=.:tests`` it records today's
code instead (which gave the same 100 cases, 2026-12-07, on AMD EPYC).
"""

from __future__ import annotations

import json
import sys

import torch

import epikv_cli

import golden_cases


def main(path: str) -> None:
    print(f"recording with {epikv_cli.__file__}", file=sys.stderr)
    out = {}
    for name in golden_cases.TINY:
        loaded = golden_cases.load_model(name)
        loaded[0].to(torch.float64)  # its float32 weights, exactly (the code of b68b429 loads float32)
        for model, spec, batch in golden_cases.all_cases():
            if model == name:
                case = golden_cases.plan(model, spec, batch, loaded[2])
                case["rows"] = golden_cases.replay(case, loaded)
                out[golden_cases.case_id(model, spec, batch)] = case
    with open(path, "w") as file:
        json.dump(out, file, separators=(",", ":"))


if __name__ == "__main__":
    main(sys.argv[1])
