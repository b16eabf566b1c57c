"""Unit tier: the package's shape. Data flows one way (docs/architecture.md, "Layers"): no
import cycle, no module importing a layer above its own, and mpi4py, pyfuse3 and zstandard each
imported by one module only. Imports are read from the source (ast), including the ones inside
functions, so a late import cannot hide an upward edge."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fanfs"

# Lower numbers are lower layers; a module may import only its own layer or lower ones.
LAYERS = {
    "errors": 0, "progress": 0, "status": 0, "native": 0, "logs": 0, "checksum": 0,
    "latency": 1, "lookahead": 0, "catalog": 1, "placement": 1, "mounts": 1, "pagecache": 1,
    "plan": 2, "torch": 3, "paths": 2, "plans": 3, "planner": 5, "plansocket": 4,
    "filters": 1, "codec": 2, "compare": 2, "datagen": 2, "staging": 2, "imagedir": 2,
    "transport.world": 2, "transport": 2, "transport.mpi": 3, "transport.inproc": 3,
    "store": 3, "image": 4, "cache": 2, "sources": 4, "reader": 5,
    "prepare.interrupt": 2, "prepare.source": 3, "prepare.dicts": 3, "prepare.pack": 3,
    "prepare.fanout": 4, "prepare.publish": 4, "prepare": 5,
    "fuse_ops": 6, "daemon": 7, "bench.launch": 7, "bench.epoch": 7, "bench": 8,
    "bench.calibrate": 8, "projection": 0,
    "cli": 9, "cli.__main__": 10, "cli.options": 8, "cli.image": 9, "cli.mount": 9,
    "cli.bench": 9, "cli.report": 8,
}  # fmt: skip
ONE_IMPORTER = {"mpi4py": "transport.world", "pyfuse3": "fuse_ops", "zstandard": "codec",
                "isal": "checksum"}  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports() -> dict[str, set[str]]:
    """module -> the fanfs modules and third-party top-level packages (as ext:NAME) it imports."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if not name:
            continue
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        targets = set()
        for imp in found:
            if imp.startswith("fanfs."):
                mod = imp[len("fanfs.") :]
                while mod and mod not in LAYERS:
                    mod = mod.rpartition(".")[0]
                if mod and mod != name:
                    targets.add(mod)
            elif imp == "fanfs":
                continue
            else:  # third-party, marked: fanfs.torch imports torch, which is not itself
                targets.add("ext:" + imp.split(".")[0])
        graph[name] = targets
    return graph


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = imports()
    assert set(graph) == set(LAYERS), set(graph) ^ set(LAYERS)
    upward = [(m, t) for m, ts in graph.items() for t in ts
              if t in LAYERS and LAYERS[t] > LAYERS[m]]  # fmt: skip
    assert upward == []


def test_no_import_cycle() -> None:
    graph = {m: {t for t in ts if t in LAYERS} for m, ts in imports().items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            assert state.get(t) != 1, " -> ".join([*path, m, t])
            if t not in state:
                visit(t, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_mpi_fuse_and_zstd_each_have_one_importer() -> None:
    graph = imports()
    for package, owner in ONE_IMPORTER.items():
        assert sorted(m for m, ts in graph.items() if f"ext:{package}" in ts) == [owner]
