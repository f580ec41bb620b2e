"""The house rules, checked on the source (STYLE.md, issues 24 and 56): no import cycle
between modules, no import from a lower layer to a higher one (LAYERS), each package
declares what it may import and imports nothing else, the library never imports its
consumers, no private name crosses a module, no product file over 400 lines, no product
folder over 20 modules, every package module reachable by its dotted name.

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
MAX_MODULES = 20
LAYERS = (
    "specforge_dspark",  # the package root: its __init__ only
    "specforge_dspark.config",
    "specforge_dspark.transport",
    "specforge_dspark.engines",
    "specforge_dspark.objective",
    "specforge_dspark.drafters",
    "specforge_dspark.decoding",
    "specforge_dspark.targets",
    "data_pipelines",
    "specforge_dspark.serving",
    "specforge_dspark.training",
    "specforge_dspark.export",
    "specforge_dspark.loop",
    "specforge_dspark.cli",
    "train",
    "evaluation",
    "scripts",
)
"""Lowest first: a module may import its own layer's modules and those of layers below."""


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


def layer_of(module: str) -> str:
    """The layer (LAYERS) a module belongs to: the longest one that is a prefix of it."""
    found = [x for x in LAYERS if module == x or module.startswith(x + ".")]
    assert found, f"{module} is in no layer of LAYERS"
    return max(found, key=len)


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a module to one in a higher layer."""
    rank = {x: i for i, x in enumerate(LAYERS)}
    return [
        f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)}, above it)"
        for m, edges in sorted(graph.items())
        for t in sorted(edges)
        if rank[layer_of(t)] > rank[layer_of(m)]
    ]


def short(layer: str) -> str:
    return layer.removeprefix("specforge_dspark.")


def declared_imports(package_init: Path) -> set[str] | None:
    """The layers a package's docstring says it may import (its `Imports:` paragraph:
    short names, or `none`), None when it says nothing."""
    doc = ast.get_docstring(ast.parse(package_init.read_text())) or ""
    if "Imports:" not in doc:
        return None
    names = doc.split("Imports:", 1)[1].split("\n\n", 1)[0].replace("\n", " ")
    return {n.strip() for n in names.split(",")} - {"none", ""}


def test_the_checker_finds_a_climb():
    graph = {"specforge_dspark.config.recipe": {"specforge_dspark.training.stream"}}
    assert climbs(graph) == [
        "specforge_dspark.config.recipe (specforge_dspark.config) imports "
        "specforge_dspark.training.stream (specforge_dspark.training, above it)"
    ]
    assert climbs({"specforge_dspark.training.stream": {"specforge_dspark.config.recipe"}}) == []


def test_no_import_climbs():
    bad = climbs({m: e for m, (e, _) in GRAPH.items()})
    assert not bad, bad


def test_each_package_imports_what_its_docstring_declares():
    """Each layer package's docstring names what it may import (`Imports:`); those are all
    below it, and it imports no other layer (the package root aside)."""
    problems = []
    for i, layer in enumerate(LAYERS[1:], start=1):
        init = REPO / layer.replace(".", "/") / "__init__.py"
        if not init.is_file():  # train, scripts: not packages
            continue
        declared = declared_imports(init)
        if declared is None:
            problems.append(f"{init.relative_to(REPO)}: no `Imports:` paragraph")
            continue
        below = {short(x) for x in LAYERS[1:i]}
        if declared - below:
            problems.append(f"{layer} declares {sorted(declared - below)}, not below it")
        used = {
            short(layer_of(t))
            for m, (edges, _) in GRAPH.items()
            if layer_of(m) == layer
            for t in edges
            if layer_of(t) not in (layer, "specforge_dspark")
        }
        if used - declared:
            problems.append(f"{layer} imports {sorted(used - declared)}, undeclared")
    assert not problems, problems


def test_no_product_folder_holds_more_than_max_modules():
    folders: dict[Path, int] = {}
    for path in SOURCES.values():
        if path.name != "__init__.py" and path.parent != REPO:
            folders[path.parent] = folders.get(path.parent, 0) + 1
    big = {str(f.relative_to(REPO)): n for f, n in folders.items() if n > MAX_MODULES}
    assert not big, f"over {MAX_MODULES} modules: {big}"


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
