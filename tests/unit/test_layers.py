"""Unit tier: the package's shape. Data flows one way (docs/architecture.md, "Layers"): no
import cycle, no module importing a layer above its own, and mpi4py, pyfuse3 and zstandard each
imported by one module only. Imports are read from the source (ast), including the ones inside
functions, so a late import cannot hide an upward edge."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fanfs"

# Lower numbers are lower layers; a module may import only its own layer or lower ones.
LAYERS = {
    "errors": 0, "progress": 0, "status": 0, "logs": 0, "native": 0, "switches": 0,
    "stopsignals": 0, "threads": 0,
    "placement": 1, "mounts": 1, "plan": 2, "world": 2, "torch": 3,
    # the image: its format, catalog, codec, checks; `fanfs info` and `verify` (image.verify)
    "image": 0, "image.checksum": 0, "image.format": 0, "image.catalog_check": 1,
    "image.catalog": 1, "image.filters": 1, "image.paths": 2, "image.codec": 2,
    "image.imagedir": 2, "image.verify": 4,
    "prepare.interrupt": 2, "prepare.source": 3, "prepare.dicts": 3, "prepare.pack": 3,
    "prepare.fanout": 4, "prepare.publish": 4, "prepare": 5,
    # the daemon's wing: everything that runs inside `fanfs mount`
    "node": 2, "node.cache": 2,
    "node.staging": 2, "node.keys": 2, "node.keep_entries": 2, "node.keep": 2, "node.order": 2,
    "node.bad": 2, "node.jobs": 2, "node.partfile": 2, "node.front": 2,
    "node.pool": 3, "node.store": 3, "node.plans": 3,
    "node.transport": 3, "node.transport.inbox": 3, "node.transport.commands": 3,
    "node.peers": 3, "node.transport.answer": 3, "node.transport.front": 3,
    "node.transport.asks": 3,
    "node.transport.mpi": 4,
    "node.transport.inproc": 4, "node.sources": 4, "node.plansocket": 4,
    "node.reader": 5, "node.planner_c": 5, "node.planner": 5, "node.fuse_ops": 6,
    "node.assemble": 7, "lifecycle": 7, "node.daemon": 8,
    # the output wing: everything that runs inside `fanfs output`
    "output": 2, "output.journal": 2, "output.dest": 2, "output.tree": 2, "output.front": 2,
    "output.apply": 2, "output.held": 3, "output.room": 4, "output.files": 4,
    "output.messages": 3, "output.lander": 3, "output.replicas": 4, "output.recover": 4,
    "output.view": 5, "output.fs": 6,
    "output.assemble": 7, "output.salvage": 7, "output.daemon": 8,
    # the bench, and its helpers (the projection model, generated data, the tree oracle)
    "bench.projection": 0, "bench.pagecache": 1, "bench.compare": 2, "bench.datagen": 2,
    "bench.data": 3, "bench.loader": 0, "bench.childmount": 1, "bench.readers": 1,
    "bench.squashfs": 2, "bench.floor": 2,
    "bench.launch": 8, "bench.epoch": 8, "bench.passes": 8, "bench.report": 8, "bench.budget": 1,
    "bench.machine": 1,
    "bench.runs": 9, "bench": 10, "bench.calibrate": 10,
    "cli": 11, "cli.__main__": 12, "cli.options": 9, "cli.image": 11, "cli.mount": 11,
    "cli.bench": 11, "cli.report": 9, "cli.output": 11, "cli.reach": 10, "cli.keep": 11,
}  # fmt: skip
# The C extension (fanfs/_native.pyx) counts as a package of its own: only fanfs/native.py,
# which checks its API version, may import it. Each daemon (a process of its own: pyfuse3 holds
# one session per process) has its own FUSE adapter: the dataset mount's and the output mount's.
ONE_IMPORTER = {"mpi4py": ["world"], "pyfuse3": ["node.fuse_ops", "output.fs"],
                "zstandard": ["image.codec"], "_native": ["native"]}  # fmt: skip


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
                named = {f"{node.module}.{a.name}" for a in node.names}
                found |= named
                # `from fanfs.image import catalog` imports the module, not the package's
                # names: the package counts only when a name is not a module of its own.
                if not all(n.startswith("fanfs.") and n[len("fanfs.") :] in LAYERS for n in named):
                    found.add(node.module)
        targets = set()
        for imp in found:
            if imp == "fanfs._native":
                targets.add("ext:_native")
            elif imp.startswith("fanfs."):
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
    for package, owners in ONE_IMPORTER.items():
        assert sorted(m for m, ts in graph.items() if f"ext:{package}" in ts) == owners


# Asking peers (which holder, in which order, the next after a failure) has one owner.
PEERS_OWNER = "node.peers"
FETCHES = {"fetch", "fetch_blocking", "fetch_batch_blocking"}  # PeerTransport's


def holder_loops(tree: ast.AST, transport: bool = False) -> list[tuple[int, str]]:
    """(line, what) of each place in a module that asks peers on its own instead of through
    fanfs/node/peers.py: a holder order of its own (a rotation `xs[k:] + xs[:k]`), a filter of
    peers by `is_dead` (`transport`: the transport package, which owns who is dead), a
    transport's fetch called on another object (only the owner asks the transport), or any
    fetch called inside a loop (a loop over holders)."""

    def rotation(node: ast.AST) -> bool:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            parts = [node.left, node.right]
        elif isinstance(node, (ast.List, ast.Tuple)):  # [*xs[k:], *xs[:k]]
            parts = [e.value for e in node.elts if isinstance(e, ast.Starred)]
        else:
            return False
        sliced = [ast.unparse(p.value) for p in parts
                  if isinstance(p, ast.Subscript) and isinstance(p.slice, ast.Slice)]  # fmt: skip
        return len(sliced) == 2 and sliced[0] == sliced[1]

    def fetch(node: ast.AST) -> ast.Attribute | None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func if node.func.attr in FETCHES else None
        return None

    found = []
    loops = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.GeneratorExp,
             ast.DictComp)  # fmt: skip
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if rotation(node):
            found.append((line, f"a holder order of its own: {ast.unparse(node)}"))
        call = node.func if isinstance(node, ast.Call) else None
        if isinstance(call, ast.Attribute) and call.attr == "is_dead" and not transport:
            found.append((line, f"peers filtered by liveness: {ast.unparse(node)}"))
        f = fetch(node)
        if f is not None and ast.unparse(f.value) != "self":
            found.append((line, f"asks the transport itself: {ast.unparse(node)}"))
        if isinstance(node, loops):
            found += [(line, f"fetches in a loop: {ast.unparse(inner)}")
                      for inner in ast.walk(node) if fetch(inner) is not None]  # fmt: skip
    return found


def test_peers_are_asked_in_one_place() -> None:
    """Which peer to ask for a file, in which order, and the next one after a refusal, a bad
    copy or a slow holder is fanfs/node/peers.py's policy (issue 40: one owner per policy),
    used by every caller (the event loop's reads, the planner's threads and batches, the MPI
    thread's fetches for the front): no other module of the daemon's wing keeps a holder loop
    of its own."""
    found = {}
    for path in sorted((PACKAGE / "node").rglob("*.py")):
        name = module_name(path)
        if name != PEERS_OWNER:
            loops = holder_loops(ast.parse(path.read_text()), name.startswith("node.transport"))
            if loops:
                found[name] = loops
    assert found == {}


def test_a_second_holder_loop_is_found() -> None:
    """The scan above can fail: each way a copy of the old holder loops looked is caught."""
    copies = {
        "ranks = ranks[k:] + ranks[:k]": 1,
        "ps = [*holders[k:], *holders[:k]]": 1,
        "live = [r for r in ranks if not self.transport.is_dead(r)]": 1,
        "got = self.transport.fetch_blocking(peer, entry, 0, n)": 1,
        "for peer in peers:\n    got = await self.fetch(peer, entry, 0, n)": 1,
    }
    for code, want in copies.items():
        assert len(holder_loops(ast.parse(code))) == want, code
    assert holder_loops(ast.parse("data = await self.fetch(peer, -1, 0, 0)")) == []


def _attribute_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, target) of every assignment to an attribute of another object than `self` (or
    through `self` into another: `self.other.attr = ...`), unless the same function created
    the object (a local name bound to a class's call: a capitalised name)."""
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        made = {t.id for node in ast.walk(func) if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call) and _constructor(node.value)
                for t in node.targets if isinstance(t, ast.Name)}  # fmt: skip
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            while any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):  # a, b.x = ...
                targets = [
                    e
                    for t in targets
                    for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
                ]
            for t in targets:
                while isinstance(t, ast.Subscript):  # x[i] = ...: the container x is written
                    t = t.value
                if not isinstance(t, ast.Attribute):
                    continue
                chain = []
                base: ast.expr = t
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    if isinstance(base, ast.Attribute):
                        chain.append(base.attr)
                    base = base.value
                owner = base.id if isinstance(base, ast.Name) else "?"
                through_self = owner == "self" and len(chain) > 1  # self.other.attr = ...
                if through_self or (owner != "self" and owner not in made):
                    found.append((node.lineno, ast.unparse(t)))
    return found


def _constructor(call: ast.Call) -> bool:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return name[:1].isupper()


# A library's own configuration object, which it documents as set before use.
CONFIGURED = {"fanfs/world.py": {"mpi4py.rc.thread_level", "mpi4py.rc.finalize"}}


def test_no_object_is_wired_from_outside() -> None:
    """The daemon's object graph is built in one place (fanfs/node/assemble.py), each object
    handed what it uses: no module sets an attribute on another object after it was built (an
    arrow no import shows). A method may set its own object's attributes (records included:
    they change through their own methods), and a function those of an object it has just
    made."""
    wired = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = f"fanfs/{path.relative_to(PACKAGE)}"
        found = [(line, target) for line, target in _attribute_writes(ast.parse(path.read_text()))
                 if target not in CONFIGURED.get(name, set())]  # fmt: skip
        if found:
            wired[name] = found
    assert wired == {}


def test_every_test_file_says_its_tier_first() -> None:
    """Each test module's docstring begins with the tier its folder gives it ("Mount tier:
    ..." in tests/mount/), so a reader of the file and the marker selection agree."""
    tests = Path(__file__).resolve().parents[1]
    wrong = {}
    for path in sorted(tests.glob("*/test_*.py")):
        tier = path.parent.name
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not doc.lower().startswith(f"{tier} tier:"):
            wrong[f"{tier}/{path.name}"] = doc[:40]
    assert wrong == {}


# Where the FANFS_* variables may be read: the CLI (options' defaults, check_environment),
# switches.py (the daemons' switches, parsed by the CLI), logs.py (the log level, checked by
# the CLI first) and the bench (it sets them for the daemons it starts).
ENV_READERS = ("cli", "switches", "logs", "bench")


def fanfs_variables(tree: ast.AST) -> list[str]:
    """The FANFS_* variables a module looks up in the environment (`environ.get("FANFS_X")`,
    `environ["FANFS_X"]`, `getenv("FANFS_X")`, the prefix "FANFS_" + a name alike)."""

    def environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "environ") or (
            isinstance(node, ast.Attribute) and node.attr == "environ")  # fmt: skip

    looked_up: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and environ(node.value):
            looked_up.append(node.slice)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr == "getenv" or (func.attr == "get" and environ(func.value)):
                looked_up.append(node.args[0])
    return [c.value for arg in looked_up for c in ast.walk(arg) if isinstance(c, ast.Constant)
            and isinstance(c.value, str) and c.value.startswith("FANFS_")]  # fmt: skip


def test_switches_are_parsed_once_by_the_cli() -> None:
    """No daemon module reads a FANFS_* variable itself: the CLI parses them once into typed
    configuration (fanfs/switches.py's Switches in MountConfig and OutputConfig)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name.split(".")[0] in ENV_READERS:
            continue
        names = fanfs_variables(ast.parse(path.read_text()))
        if names:
            found[name] = names
    assert found == {}
    # ... and the scan sees one when it is there.
    assert fanfs_variables(ast.parse('os.environ.get("FANFS_FRONT", "1")')) == ["FANFS_FRONT"]


MAX_MODULE_LINES = 400  # a module longer than this holds more than one concern: split it


def test_no_module_is_over_400_lines() -> None:
    """Every module of the package is one concern (issue 40); the C's files have their own
    bound (test_native_layout.py)."""
    long = {module_name(p): n for p in PACKAGE.rglob("*.py")
            if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}  # fmt: skip
    assert long == {}
