"""Sanitizers tier: fanfs's C under AddressSanitizer, UndefinedBehaviorSanitizer and
ThreadSanitizer, and built as on RHEL 8. Run once, not again under every Python.

tests/native/pool_stress.c (with front_stress.c) stresses the pool, its cache, peers' pieces,
the front and its writes behind from many threads at once (READs meeting on pieces, evictions,
dictionaries replaced while jobs decode, transient failures, threads that end, a scripted
kernel's requests, stops with requests in flight, a kernel that goes away), built with ASan,
UBSan and LeakSanitizer, then with TSan: any report, a lost or wrong reply, a leak, fails it.

The extension itself (fanfs/_native.c, Cython's output, and fanfs/csrc/) is built again with
`-fsanitize=address,undefined` at -O0 (a build in seconds, where -O2 takes a minute), into a
copy of the package, and this machine's Python loads it with the sanitizers' runtimes
preloaded. The native unit tests and the scripted kernels' (the pool without FUSE, the
decoders, the front's answers and writes) then run against it in a subprocess; any
report ends that process with exit code 66 and fails this test. Leaks are not looked for here
(Python keeps memory to its exit by design); pool_stress.c does.

Every C file also compiles with the names linux/fuse.h gained after protocol 7.27 poisoned
(tests/native/fuse_7_27.h): the build machines of RHEL 8 have no newer header.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard

from fanfs.image import filters
from fanfs.native import lib

ROOT = Path(__file__).resolve().parents[2]
# Every C file of the extension (setup.py builds the same glob): a file added is built,
# checked and stressed here with no list to update.
C_SOURCES = sorted((ROOT / "fanfs" / "csrc").glob("*.c"))
# The tests that drive the C (the pool without FUSE, the decoders, the front and its writes
# under a scripted kernel, its buffers kept in a file); those of Python's read path add
# preparing images, not C.
TESTS = [
    ROOT / "tests" / f
    for f in ("unit/test_native.py", "adapter/test_kernels.py", "unit/test_kept_writes.py")
]


def _fuse3(flag: str) -> list[str]:
    return subprocess.run(["pkg-config", flag, "fuse3"], capture_output=True, text=True,
                          check=True).stdout.split()  # fmt: skip


def _runtime(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    assert os.path.isabs(path), f"gcc has no {name} (apt-get install gcc)"
    return path


def test_the_native_tests_pass_with_the_extension_under_address_sanitizer(
    tmp_path: Path,
) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    generated = ROOT / "fanfs" / "_native.c"
    assert generated.exists(), "fanfs/_native.c is made by the install (`make setup`)"
    package = tmp_path / "fanfs"
    shutil.copytree(ROOT / "fanfs", package,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))  # fmt: skip
    ext = package / ("_native" + str(sysconfig.get_config_var("EXT_SUFFIX")))
    csrc = ROOT / "fanfs" / "csrc"
    built = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O0", "-g", "-fno-omit-frame-pointer",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{csrc}",
         f"-I{sysconfig.get_paths()['include']}", *_fuse3("--cflags"), str(generated),
         *map(str, C_SOURCES), "-o", str(ext),
         *_fuse3("--libs"), "-ldl", "-lpthread"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    env = {**os.environ, "PYTHONPATH": str(tmp_path),
           "LD_PRELOAD": f"{_runtime('libasan.so')}:{_runtime('libubsan.so')}",
           "ASAN_OPTIONS": "detect_leaks=0:exitcode=66:abort_on_error=0",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=66"}  # fmt: skip
    probe = "import fanfs.native as n; print(n.lib.__file__)"
    which = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=60)  # fmt: skip
    assert which.stdout.strip() == str(ext), which.stdout + which.stderr
    # Run from the copy's directory: `python -m` puts the working directory first on the path,
    # and the checkout's own fanfs/ (with the normal build) must not be the one imported.
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "-k",
         "not sanitizer", *map(str, TESTS)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    out = ran.stdout[-6000:] + ran.stderr[-6000:]
    assert ran.returncode == 0, out
    assert "Sanitizer" not in ran.stderr and "runtime error" not in ran.stderr, out


# Every C file compiles clean with -Wall -Wextra (-Werror: a warning fails it), but those named
# here, which are checked with -Wall until their warnings are fixed, each with why.


@pytest.mark.parametrize("source", [p.name for p in C_SOURCES])
def test_the_c_builds_with_rhel_8s_kernel_headers(source: str, tmp_path: Path) -> None:
    """With -Wall -Wextra -Werror too: a warning is an error in the C (not in setup.py's build,
    since Cython's generated C warns)."""
    csrc, native = ROOT / "fanfs" / "csrc", ROOT / "tests" / "native"
    unit = tmp_path / "unit.c"
    poisoned = native / "fuse_7_27.h"
    unit.write_text(f'#define _GNU_SOURCE\n#include <linux/fuse.h>\n#include "{poisoned}"\n'
                    f'#include "{csrc / source}"\n')  # fmt: skip
    warnings = ["-Wall", "-Wextra", "-Werror"]
    built = subprocess.run(["gcc", "-fsyntax-only", *warnings, f"-I{csrc}", *_fuse3("--cflags"),
                            str(unit)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert built.returncode == 0 and "poisoned" not in built.stderr, built.stderr[-4000:]


@pytest.mark.parametrize("source", ["plane.c", "plane_wire.c", "plane_read.c"])
def test_the_data_plane_builds_with_mpi_h(source: str) -> None:
    """The data plane as setup.py builds it where mpicc gives mpi.h's directories (the test
    above builds it without), with -Werror too."""
    found = subprocess.run(["mpicc", "--showme:incdirs"], capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    csrc = ROOT / "fanfs" / "csrc"
    includes = [f"-I{csrc}", *(f"-I{d}" for d in found)]
    flags = ["-Wall", "-Wextra", "-Werror", "-DFANFS_PLANE", *includes]
    unit = [*flags, *_fuse3("--cflags"), str(csrc / source)]
    built = subprocess.run(["gcc", "-fsyntax-only", *unit], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]


# -- the C under sanitizers -------------------------------------------------------------------

NATIVE = ROOT / "tests" / "native"
CSRC = ROOT / "fanfs" / "csrc"
SANITIZERS = {
    "address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "thread": ["-fsanitize=thread"],
}


@pytest.fixture(scope="module")
def stress_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pieces of every kind for tests/native/pool_stress.c: many small raw ones (so that READs
    meet on them and the cache evicts), zstd with and without the dictionary, filtered, and one
    large raw piece."""
    rng = np.random.default_rng(11)
    out = tmp_path_factory.mktemp("stress")
    samples = [f"row {i},{i * 7 % 13},label-{i % 5}\n".encode() * 20 for i in range(400)]
    d = zstandard.train_dictionary(4096, samples, dict_id=1)
    with_dict = zstandard.ZstdCompressor(dict_data=d, write_dict_id=True)
    plain = zstandard.ZstdCompressor()
    pieces: list[tuple[bytes, int, bytes]] = []  # (stored, kind, decoded)
    for _ in range(48):
        data = rng.bytes(int(rng.integers(4 << 10, 60 << 10)))
        pieces.append((data, lib.KIND_RAW, data))
    for i in range(8):
        data = b"".join(samples[i * 40 : i * 40 + 40])
        pieces.append((with_dict.compress(data), lib.KIND_ZSTD, data))
        pieces.append((plain.compress(data), lib.KIND_ZSTD, data))
    for i in range(4):
        data = np.cumsum(rng.normal(size=(64 << 10) + i)).astype("f4").tobytes()
        encoded = filters.encode(filters.SHUFFLE4, data)
        assert encoded is not None
        pieces.append((plain.compress(encoded), lib.KIND_FILTER + filters.SHUFFLE4, data))
    big = rng.bytes(6 << 20)
    pieces.append((big, lib.KIND_RAW, big))
    lines, part, dec = [], bytearray(), bytearray()
    for stored, kind, data in pieces:
        part += bytes(int(rng.integers(0, 5000)))  # pieces at any offset
        off = len(part)
        part += stored
        lines.append(f"{off} {len(stored)} {zlib.crc32(stored)} {len(data)} {kind} {len(dec)}\n")
        dec += data
    (out / "part.bin").write_bytes(part)
    (out / "decoded.bin").write_bytes(dec)
    (out / "dict.bin").write_bytes(d.as_bytes())
    (out / "pieces.txt").write_text("".join(lines))
    return out


# The harness's checks this test runs (all of them once each finding is fixed).
STRESS_PARTS = "evict remote swap transient cache ended front writes"
STRESS_LEAKS = True


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_the_pool_under_sanitizers(stress_data: Path, tmp_path: Path, sanitizer: str) -> None:
    """tests/native/pool_stress.c (READs meeting on pieces, evictions, drops, dictionaries
    replaced while jobs decode, transient failures, threads that end, the pool's stop) and
    tests/native/front_stress.c (the front's threads under concurrent LOOKUP, GETATTR, READ and
    forwarded requests, stopped while they come, a session ended under them; the output
    front's writes behind, held fds, its stop under WRITEs) built with AddressSanitizer and
    UndefinedBehaviorSanitizer, then ThreadSanitizer: any report, a lost, doubled or wrong
    reply, a leak, fails it."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    exe = tmp_path / f"pool_stress_{sanitizer}"
    harness = [NATIVE / "pool_stress.c", NATIVE / "front_stress.c"]
    sources = [*harness, *C_SOURCES]
    cmd = ["gcc", "-g", "-O1", "-fno-omit-frame-pointer", *SANITIZERS[sanitizer],
           f"-I{CSRC}", *_fuse3("--cflags"), *map(str, sources), "-o", str(exe),
           *_fuse3("--libs"), "-ldl", "-lpthread"]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    env = {**os.environ, "ASAN_OPTIONS": f"detect_leaks={int(STRESS_LEAKS)}:exitcode=66",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
           "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:second_deadlock_stack=1"}  # fmt: skip
    ran = subprocess.run([str(exe), str(stress_data), STRESS_PARTS], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert ran.returncode == 0 and "pool_stress: ok" in ran.stdout, ran.stderr[-6000:]
    assert "Sanitizer" not in ran.stderr and "runtime error" not in ran.stderr, ran.stderr[-6000:]
