"""Unit tier: the native core's C by concern (issue 40). Each file of fanfs/csrc holds one
concern in at most MAX_LINES lines, and keeps its state in objects handed to its functions: no
mutable file-scope variable but the few handles allowed below, each with its reason.

A file-scope variable is found by a regex over the top-level declarations of each file (column
0, outside comments): `static` ones that are not `const` objects. That is enough for the house
style here, where every top-level declaration starts at column 0 and state is declared
`static` (a non-static one would be a symbol the header does not declare).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "fanfs" / "csrc"
MAX_LINES = 500  # a concern a reader holds in mind at once; squashfuse's files are about this

# (file, name): why this one object may live at file scope.
ALLOWED = {
    ("pool.c", "live"): "the one pool object, the handle fanfs_native.h's functions resolve "
    "(they take none)",
    ("codec.c", "codec"): "the libraries, loaded once for the process (pthread_once), and "
    "the count of bytes all threads' buffers keep (atomic): one object",
    ("stored.c", "reads"): "process-wide read counters and a flag, all atomic: one object",
    ("front.c", "bound"): "pyfuse3's receiver hook takes no argument of ours: the front it "
    "reads from (atomic; the lever: a context pointer in tools/pyfuse3_patch's hook)",
    ("cpu.c", "cpu"): "the machine's CPU pressure, sampled for every front of the process: "
    "one object, its lock inside",
    ("plane.c", "plane"): "the one data plane of the process (one MPI communicator, one "
    "thread), the handle fanfs_native.h's plane functions resolve (they take none), as pool.c's "
    "`live`",
}
# Kinds of declaration that are never shared mutable state.
ALLOWED_KINDS = (
    "pthread_once_t",  # the once-only guard itself
    "__thread",  # each thread's own
)
TOP_STATIC = re.compile(r"^static\b(?P<head>[^(;={]*?)(?P<body>\{)?\s*(?:=|;|\[|$)", re.M)
CLOSING = re.compile(r"^\}\s*(?P<name>\w+)\s*(?:=|;)", re.M)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def mutable_statics(text: str) -> list[str]:
    """The names of the mutable file-scope variables declared in C source `text`."""
    names: list[str] = []
    lines = _strip_comments(text).split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.startswith("static ") or "(" in line.split("=")[0]:
            continue  # not a static, or a function (its prototype or definition)
        head = line.split("=")[0].rstrip(" ;{")
        if re.match(r"static\s+(struct|union|enum)\s*\w*\s*\{?$", head) and "{" in line:
            # An (anonymous) struct's definition: its variable follows the closing brace.
            while i < len(lines) and not lines[i].startswith("}"):
                i += 1
            closing = CLOSING.match(lines[i]) if i < len(lines) else None
            i += 1
            if closing is not None:
                names.append(closing.group("name"))
            continue
        if any(kind in head.split() for kind in ALLOWED_KINDS):
            continue
        words = head.replace("*", " * ").split()
        const_object = "const" in words and (
            "*" not in words or words[len(words) - 1 - words[::-1].index("*") + 1] == "const"
        )
        if const_object:
            continue
        for decl in head[len("static") :].split(","):
            m = re.search(r"(\w+)\s*(\[[^\]]*\])?\s*$", decl)
            if m is not None:
                names.append(m.group(1))
    return names


def test_the_parser_finds_what_it_must() -> None:
    sample = """
static int plain;
static uint64_t a, b, c;
static const double table[3] = {1, 2, 3};
static const char *name = "x";
static pthread_once_t once = PTHREAD_ONCE_INIT;
static __thread struct x *mine;
static struct {
    int n;
} anon = {0};
static struct pool live = {
    .n = 1,
};
static int f(void) {
    static int inside;
    return inside;
}
static void g(int x);
/* static int in_a_comment; */
"""
    assert mutable_statics(sample) == ["plain", "a", "b", "c", "name", "anon", "live"]


SOURCES = sorted(CSRC.glob("*.c"))


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_each_c_file_is_one_concern_with_its_state_in_objects(path: Path) -> None:
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines (at most {MAX_LINES}: split it)"
    loose = [n for n in mutable_statics(text) if (path.name, n) not in ALLOWED]
    assert not loose, (
        f"{path.name}: mutable file-scope state {loose}: put it in the concern's struct, "
        "handed to its functions (or allow it here, with why)"
    )


def test_the_allowlist_names_only_what_exists() -> None:
    found = {(p.name, n) for p in SOURCES for n in mutable_statics(p.read_text())}
    assert set(ALLOWED) <= found, set(ALLOWED) - found
