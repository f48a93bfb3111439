"""Adding a policy touches its file, its registry line and its own tests: removing one must leave the rest whole.

``python tests/policy_removal.py [PYTEST ARGS]`` copies the repository (the files git tracks) to a temporary
directory, removes knorm there (``epikv_cli/policies/knorm.py``, its line in ``epikv_cli/policies/catalog.py``
and ``tests/test_policies_knorm.py``), regenerates the completions and man page (``make docs``), and runs the
suite there (``-n auto`` unless PYTEST ARGS say otherwise). ``tests/test_layout.py`` does the same with the
collection and the lint alone, in every ``make test``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICY = "knorm"
REMOVED = (f"epikv_cli/policies/{POLICY}.py", f"tests/test_policies_{POLICY}.py")


def copy_without_policy(target: Path, policy: str = POLICY) -> Path:
    """A copy of the files git tracks (or would) in ``target``, less ``policy``'s file, registry line and tests."""
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    for name in (f"epikv_cli/policies/{policy}.py", f"tests/test_policies_{policy}.py"):
        (target / name).unlink()
    registry = target / "epikv_cli/policies/catalog.py"
    lines = registry.read_text().splitlines(keepends=True)
    kept = [line for line in lines if f"epikv_cli.policies.{policy}:" not in line]
    if len(kept) != len(lines) - 1:
        raise RuntimeError(f"expected exactly one registry line for {policy}")
    registry.write_text("".join(kept))
    run(target, "-m", "epikv_cli.cli.docgen")  # make docs: the completions list the policies
    return target


def run(target: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``target``, importing the copy's package rather than the installed one."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run([sys.executable, *args], cwd=target, env=env, capture_output=True, text=True, check=check)


def main(pytest_args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="epikv-without-knorm-") as tmp:
        target = copy_without_policy(Path(tmp))
        result = run(target, "-m", "pytest", "-q", *(pytest_args or ["-n", "auto"]), check=False)
        print(result.stdout[-3000:], result.stderr[-2000:], sep="\n")
        return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
