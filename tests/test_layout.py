"""The package's shape: no import cycle between its modules (the layer contracts in pyproject.toml, checked by
``lint-imports`` in ``make lint``, keep the layers in order; this keeps each layer's own modules acyclic)."""

from __future__ import annotations

import grimp


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
