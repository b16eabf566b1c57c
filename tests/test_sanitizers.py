"""Sanitizers tier: fanfs's C under AddressSanitizer and UndefinedBehaviorSanitizer, and
built as on RHEL 8.

The extension itself (fanfs/_native.c, Cython's output, and fanfs/csrc/) is built again with
`-fsanitize=address,undefined` at -O0 (a build in seconds, where -O2 takes a minute), into a
copy of the package, and this machine's Python loads it with the sanitizers' runtimes
preloaded. The native unit and adapter tests (the pool without FUSE, the C's answers to a
scripted kernel, pieces read and checked, the codec) then run against it in a subprocess; any
report ends that process with exit code 66 and fails this test. Leaks are not looked for here
(Python keeps memory to its exit by design); tests/native/pool_stress.c does, in test_native.

Every C file also compiles with the names linux/fuse.h gained after protocol 7.27 poisoned
(tests/native/fuse_7_27.h): the build machines of RHEL 8 have no newer header.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = [ROOT / "tests" / f for f in ("test_native.py", "test_kernels.py",
                                      "test_read_pieces.py", "test_codec.py")]  # fmt: skip


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
         *(str(csrc / f) for f in ("codec.c", "pool.c", "front.c", "writes.c")), "-o", str(ext),
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


@pytest.mark.parametrize("source", ["front.c", "pool.c", "writes.c", "codec.c"])
def test_the_c_builds_with_rhel_8s_kernel_headers(source: str, tmp_path: Path) -> None:
    csrc, native = ROOT / "fanfs" / "csrc", ROOT / "tests" / "native"
    unit = tmp_path / "unit.c"
    poisoned = native / "fuse_7_27.h"
    unit.write_text(f'#define _GNU_SOURCE\n#include <linux/fuse.h>\n#include "{poisoned}"\n'
                    f'#include "{csrc / source}"\n')  # fmt: skip
    built = subprocess.run(["gcc", "-fsyntax-only", "-Wall", f"-I{csrc}", *_fuse3("--cflags"),
                            str(unit)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert built.returncode == 0 and "poisoned" not in built.stderr, built.stderr[-4000:]
