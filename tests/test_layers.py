"""shardflow's layers (docs/concepts.md#6-layers-who-may-import-whom): every import among ``shardflow/`` modules —
at module level, inside a function, under ``TYPE_CHECKING`` — goes to the importer's own package or to a package of
a lower layer, and no modules import each other in a circle. The layer order is read from the doc's table, so the
doc states what this test holds."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "shardflow"
ROW = re.compile(r"\| (\d+) \| ((?:`[\w.]+`(?:, )?)+) \|")


def layers() -> dict[str, int]:
    """Package (the name after ``shardflow.``; ``__init__`` for the package's own face) → its layer, 1 the
    lowest, from the table of docs/concepts.md."""
    rows = [ROW.match(line) for line in (ROOT / "docs" / "concepts.md").read_text().splitlines()]
    return {name: int(m.group(1)) for m in rows if m for name in re.findall(r"`([\w.]+)`", m.group(2))}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(module: str) -> list[tuple[str, int]]:
    """(shardflow module imported, line) for every import statement of ``module``, wherever it stands. ``from P
    import x`` imports module ``P.x`` where that is a module, else ``P``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            out += [(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, node.lineno) for a in node.names]
    return [(name, line) for name, line in out if name in MODULES]


GRAPH = {m: imports(m) for m in MODULES}


def test_every_package_has_a_layer():
    assert sorted({package_of(m) for m in MODULES}) == sorted(layers())


def test_no_import_goes_up_a_layer_or_across_one():
    """A module imports its own package or a lower layer: never a higher one, never another package of its own."""
    layer = layers()
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{line}: {m} (layer {layer[package_of(m)]}) imports {target} "
        f"(layer {layer[package_of(target)]})"
        for m, targets in GRAPH.items()
        for target, line in targets
        if package_of(target) != package_of(m) and layer[package_of(target)] >= layer[package_of(m)]
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    sorter = graphlib.TopologicalSorter({m: {t for t, _ in targets} for m, targets in GRAPH.items()})
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"modules import each other in a circle: {' -> '.join(e.args[1])}") from None
