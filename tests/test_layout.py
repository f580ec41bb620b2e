"""The house rules, checked on the source (STYLE.md, issue 24): no import cycle between
modules, the library never imports its consumers, no private name crosses a module, no
product file over 500 lines, every package module reachable by its dotted name.

Every import counts, also those inside functions and under TYPE_CHECKING: a cycle hidden
by a function-local import is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("specforge_dspark", "evaluation", "data_pipelines")
PRODUCT = [*PACKAGES, "scripts"]
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {"train": REPO / "train.py"}
    for pkg in PRODUCT:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if "shims" in path.parts:  # stand-in packages for another process (sglang)
                continue
            out[_module_name(path)] = path
    return out


SOURCES = _sources()


def _resolve(name: str) -> str | None:
    """The repo module a dotted import name lands in (longest known prefix), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in SOURCES:
            return candidate
    return None


def _imports(module: str, path: Path) -> tuple[set[str], list[str]]:
    """(repo modules `module` imports, private names it takes from other modules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    private: list[str] = []
    module_aliases: dict[str, str] = {}  # local name -> repo module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    edges.add(target)
                    if alias.asname:
                        module_aliases[alias.asname] = target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in SOURCES:  # `from pkg import module`
                    edges.add(sub)
                    module_aliases[alias.asname or alias.name] = sub
                    continue
                target = _resolve(base)
                if target:
                    edges.add(target)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{module}: from {base} import {alias.name}")
    for node in ast.walk(tree):  # `mod._name` through a module bound by an import
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and module_aliases[node.value.id] != module
        ):
            private.append(f"{module}: {module_aliases[node.value.id]}.{node.attr}")
    edges.discard(module)
    return edges, private


GRAPH = {m: _imports(m, p) for m, p in SOURCES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_and_a_private_import(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    mod = tmp_path / "probe.py"
    mod.write_text(
        "from specforge_dspark.training import checkpoint\n"
        "def f():\n"
        "    from specforge_dspark.config.recipe import _hidden\n"
        "    return checkpoint._secret, _hidden\n"
    )
    edges, private = _imports("specforge_dspark.probe", mod)
    assert {"specforge_dspark.training.checkpoint", "specforge_dspark.config.recipe"} <= edges
    assert len(private) == 2, private


def test_no_import_cycles():
    cycles = _cycles({m: e for m, (e, _) in GRAPH.items()})
    assert not cycles, f"import cycles: {cycles}"


def test_the_library_never_imports_its_consumers():
    bad = [
        f"{m} imports {t}"
        for m, (edges, _) in GRAPH.items()
        if m.startswith(("specforge_dspark", "data_pipelines")) or m == "train"
        for t in edges
        if t.startswith(("evaluation", "scripts"))
    ]
    assert not bad, bad


def test_no_private_name_crosses_a_module():
    bad = [p for _, (_, private) in GRAPH.items() for p in private]
    assert not bad, bad


def test_product_files_stay_readable():
    long = {
        str(path.relative_to(REPO)): n
        for path in SOURCES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_product_module_reads_a_fault_switch():
    """Faults are injected from the test side (tests/inject/drills.py): no product module,
    cpu/shims included, names a fault-injection variable, so a stray one in a user's
    environment can never kill a save, limit a file or poison a loss."""
    from tests.inject.drills import VARIABLES

    switches = {*VARIABLES, "SPECFORGE_KILL", "SPECFORGE_INJECT", "SPECFORGE_STREAM_REPLAY"}
    files = [REPO / "train.py", *sorted((REPO / "specforge_dspark").rglob("*.py"))]
    bad = [
        f"{path.relative_to(REPO)}: {name}"
        for path in files
        for name in sorted(switches)
        if name in path.read_text()
    ]
    assert not bad, bad


def test_the_readme_is_a_front_door():
    """The README rule with the others (STYLE.md item 11): at most 200 lines, every link of
    README.md and docs/*.md resolves (tests/test_readme.py holds these checks, the
    two-commands and measured.md rules, and the tests that they can fail)."""
    from tests.test_readme import MAX_README_LINES, broken_links

    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines"
    assert not broken_links(REPO), broken_links(REPO)
