"""Builds fanfs's one extension module, fanfs._native (fanfs/_native.pyx and fanfs/csrc/).

Everything else is in pyproject.toml. The extension links libfuse3 (its pool replies to FUSE
requests itself); the headers come from pkg-config, as pyfuse3's own build finds them
(tools/setup_system.sh installs libfuse3-dev).
"""

import os
import shlex
import subprocess
from glob import glob

from Cython.Build import cythonize
from setuptools import Extension, setup


def fuse3(flag: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", flag, "fuse3"], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit("fanfs: libfuse3's headers are missing (apt-get install libfuse3-dev "
                         "pkg-config, or run tools/setup_system.sh)") from None
    return shlex.split(out)


def mpi_includes() -> list[str]:
    """mpi.h's directories, from the MPI compiler wrapper ($MPICC, else mpicc: Open MPI's
    --showme:incdirs, MPICH's -show); none when there is no wrapper. The data plane
    (fanfs/csrc/plane.c) is built only with them; it links no MPI (it calls the library mpi4py
    loaded), so the module imports where MPI is absent."""
    wrapper = os.environ.get("MPICC", "mpicc")
    for args, parse in (([wrapper, "--showme:incdirs"], str.split),
                        ([wrapper, "-show"], lambda out: [w[2:] for w in shlex.split(out)
                                                         if w.startswith("-I")])):  # fmt: skip
        try:
            out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        dirs = parse(out)
        if any(os.path.exists(os.path.join(d, "mpi.h")) for d in dirs):
            return dirs
    return []


cflags = fuse3("--cflags")
mpi = mpi_includes()
native = Extension(
    "fanfs._native",
    # Every C file of fanfs/csrc, one per concern (tests/sanitizers/test_sanitizers.py builds the same).
    ["fanfs/_native.pyx", *sorted(glob("fanfs/csrc/*.c"))],
    include_dirs=["fanfs/csrc", *(f[2:] for f in cflags if f.startswith("-I")), *mpi],
    define_macros=[("FANFS_PLANE", "1")] if mpi else [],
    extra_compile_args=[f for f in cflags if not f.startswith("-I")] + ["-O2", "-Wall"],
    extra_link_args=fuse3("--libs") + ["-ldl", "-lpthread"],
    depends=sorted(glob("fanfs/csrc/*.h")),
)
setup(ext_modules=cythonize([native], language_level=3, quiet=True))
