"""The package's shape: no import cycle between its modules (the layer contracts in pyproject.toml, checked by
``lint-imports`` in ``make lint``, keep the layers in order; this keeps each layer's own modules acyclic)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from policy_removal import POLICY, copy_without_policy, run

import epikv_cli


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("epikv_cli", exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported != module and graph.chain_exists(importer=imported, imported=module):
                cycles.append([module, *graph.find_shortest_chain(importer=imported, imported=module)])
    assert cycles == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules that import each other are found."""
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\n")
    (package / "b.py").write_text("from cyclic import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclic", cache_dir=None)
    assert graph.chain_exists(importer="cyclic.a", imported="cyclic.b")
    assert graph.chain_exists(importer="cyclic.b", imported="cyclic.a")


@pytest.mark.long
def test_a_policy_is_removed_by_removing_its_file_its_registry_line_and_its_tests(tmp_path):
    """docs/adding-a-policy.md's claim, in a copy without knorm: the package imports, the layer contracts and
    ruff hold, the completions are regenerated without it, and the whole suite still collects
    (``python tests/policy_removal.py`` runs all of it there)."""
    target = copy_without_policy(tmp_path)
    names = run(target, "-c", "from epikv_cli.policies.registry import POLICIES; print(*sorted(POLICIES))")
    assert POLICY not in names.stdout.split() and "epikv2" in names.stdout.split()
    assert POLICY not in (target / "completions" / "epikv.bash").read_text()
    collected = run(target, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", check=False)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert "error" not in collected.stdout.splitlines()[-1]
    ruff = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "epikv_cli", "tests"], cwd=target, capture_output=True
    )
    assert ruff.returncode == 0, ruff.stdout.decode()[-2000:]


#: What an experiment may not touch: it returns records, and the CLI decides what reaches the terminal.
PRINTING_NAMES = {"print"}
PRINTING_STREAMS = {"stdout", "stderr", "__stdout__", "__stderr__"}


def printing(source: str) -> list[str]:
    """Each place in ``source`` that prints: a use of ``print``, or ``sys.stdout`` / ``sys.stderr`` (attribute or
    ``from sys import``), as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in PRINTING_NAMES:
            found.append(f"{node.lineno}: {node.id}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in PRINTING_STREAMS
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            found.append(f"{node.lineno}: sys.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            found += [f"{node.lineno}: from sys import {a.name}" for a in node.names if a.name in PRINTING_STREAMS]
    return sorted(found, key=lambda place: int(place.split(":")[0]))


def test_experiments_never_print():
    """Experiments return records and take progress callbacks; only the CLI writes to stdout or stderr."""
    experiments = Path(epikv_cli.__file__).parent / "experiments"
    modules = sorted(experiments.rglob("*.py"))
    assert {path.stem for path in modules} >= {"profile", "maxcontext", "fidelity", "evaluate", "calibrate"}
    offences = {str(path.relative_to(experiments)): found for path in modules if (found := printing(path.read_text()))}
    assert offences == {}


def test_the_print_check_sees_printing():
    """The check above can fail: each way of printing is found, and a stream named otherwise is not."""
    source = (
        "import sys\n"
        "from sys import stderr\n"
        "print('x')\n"
        "log = print\n"
        "sys.stdout.write('x')\n"
        "sys.stderr.flush()\n"
        "subprocess.Popen([], stdout=subprocess.DEVNULL)\n"
        "sys.stdin.readline()\n"
    )
    assert printing(source) == [
        "2: from sys import stderr",
        "3: print",
        "4: print",
        "5: sys.stdout",
        "6: sys.stderr",
    ]
