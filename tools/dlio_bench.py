"""The DLIO benchmark (the DL I/O emulator behind MLPerf Storage) on the source and on fanfs.

Run on demand (heavy: DLIO pulls tensorflow-cpu, about 1.3 GB, into its own environment):

    .venv/bin/python tools/dlio_bench.py [--workdir DIR] [--repeat N]

1. installs dlio-benchmark 2.0.0 into `.venv-dlio` the way docs/environment.md describes
   (`--no-deps`, then its light dependencies, tensorflow-cpu and the local CPU torch);
2. generates the unet3d (npz) and resnet50 (jpeg, PyTorch loader) workloads, scaled down to
   this machine, with DLIO itself;
3. prepares each with fanfs, and runs DLIO's training emulation with 2 MPI ranks, alternately
   on the source directory and on a 2-daemon fanfs mount (rank r reads through daemon r's
   mount), with the kernel caches dropped before each run when root;
4. prints samples/s, accelerator utilisation (AU) and MB/s side by side with the fanfs/native
   ratio, and writes them as JSON to DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fanfs.bench import drop_caches

REPO = Path(__file__).resolve().parent.parent
FANFS = Path(sys.executable).with_name("fanfs")
DLIO_VENV = REPO / ".venv-dlio"
DLIO = DLIO_VENV / "bin" / "dlio_benchmark"
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIRUN = ["mpirun", "--oversubscribe", "-np", "2"]

# Scaled down from MLPerf Storage: unet3d ~4 MiB npz samples, resnet50 ~110 KiB JPEGs. A small
# computation time keeps the emulated accelerator hungry, so I/O decides the result.
WORKLOADS: dict[str, list[str]] = {
    "unet3d": [
        "workload=unet3d_a100", "++workload.dataset.num_files_train=48",
        "++workload.dataset.record_length=4194304",
        "++workload.dataset.record_length_stdev=1048576",
        "++workload.dataset.record_length_resize=2097152", "++workload.reader.batch_size=2",
        "++workload.reader.read_threads=1", "++workload.train.epochs=3",
        "++workload.train.computation_time=0.05", "++workload.workflow.checkpoint=False",
    ],
    "resnet50": [
        "workload=resnet50_a100", "++workload.framework=pytorch",
        "++workload.reader.data_loader=pytorch", "++workload.dataset.format=jpeg",
        "++workload.dataset.num_samples_per_file=1", "++workload.dataset.num_files_train=1024",
        "++workload.dataset.record_length=114660", "++workload.reader.batch_size=16",
        "++workload.reader.read_threads=1", "++workload.reader.computation_threads=1",
        "++workload.train.computation_time=0.02", "++workload.train.epochs=3",
    ],
}  # fmt: skip


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, env=ENV, text=True, capture_output=True, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        sys.exit(f"dlio_bench: failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-3000:]}"
                 f"\n{done.stderr[-3000:]}")  # fmt: skip
    return done  # type: ignore[no-any-return]


def install() -> None:
    if DLIO.exists():
        return
    print("dlio_bench: installing dlio-benchmark 2.0.0 into .venv-dlio (a few minutes)", flush=True)
    pip = [str(DLIO_VENV / "bin" / "pip"), "install", "-q"]
    run([sys.executable, "-m", "venv", str(DLIO_VENV)])
    run([*pip, "--no-deps", "dlio-benchmark==2.0.0"])
    run([*pip, "Pillow", "PyYAML", "h5py", "mpi4py", "numpy", "omegaconf", "pandas", "psutil",
         "pydftracer==1.0.2", "hydra-core", "tensorflow-cpu", "torch==2.13.0"])  # fmt: skip


def dlio(work: Path, name: str, folder: str, out: Path, *extra: str) -> dict[str, float]:
    """One DLIO training run with 2 ranks; `folder` may contain $OMPI_COMM_WORLD_RANK."""
    args = [*WORKLOADS[name], "++workload.workflow.generate_data=False",
            "++workload.workflow.train=True", f"++workload.dataset.data_folder={folder}",
            f"++hydra.run.dir={out}", *extra]  # fmt: skip
    quoted = " ".join(f"'{a}'" if "$" not in a else f'"{a}"' for a in args)
    run([*MPIRUN, "bash", "-c", f"exec {DLIO} {quoted}"], cwd=work, timeout=1800)
    metric = json.loads((out / "summary.json").read_text())["metric"]
    return {
        "samples_per_s": metric["train_throughput_mean_samples_per_second"],
        "au_percent": metric["train_au_mean_percentage"],
        "mb_per_s": metric["train_io_mean_MB_per_second"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fanfs-dlio"))
    ap.add_argument("--repeat", type=int, default=2, help="runs per reader (median reported)")
    args = ap.parse_args()
    work = args.workdir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    install()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name in WORKLOADS:
        src, image = work / "src" / name, work / f"{name}.fanfs"
        if not src.exists():
            print(f"dlio_bench: generating {name}", flush=True)
            run([*MPIRUN, str(DLIO), *WORKLOADS[name], "++workload.workflow.generate_data=True",
                 "++workload.workflow.train=False", f"++workload.dataset.data_folder={src}",
                 f"++hydra.run.dir={work / 'out' / (name + '-gen')}"],
                cwd=work, timeout=1800)  # fmt: skip
        run([str(FANFS), "-q", "prepare", str(src), str(image), "--force"])
        mnts = [work / f"mnt-{r}" for r in range(2)]
        for m in mnts:
            m.mkdir(exist_ok=True)
        daemons = subprocess.Popen(
            [*MPIRUN, "--enable-recovery", str(FANFS), "-q", "mount", str(image),
             str(work / "mnt-{rank}"), "--local", str(work / "local-{rank}")], env=ENV,
        )  # fmt: skip
        runs: dict[str, list[dict[str, float]]] = {"native": [], "fanfs": []}
        try:
            for m in mnts:
                run([str(FANFS), "wait", str(m), "--timeout", "120"])
            for i in range(args.repeat):
                for reader, folder in (("native", str(src)),
                                       ("fanfs", f"{work}/mnt-$OMPI_COMM_WORLD_RANK")):  # fmt: skip
                    drop_caches()
                    # A new directory per run: nothing already in DIR is ever removed.
                    (work / "out").mkdir(exist_ok=True)
                    out = Path(tempfile.mkdtemp(prefix=f"{name}-{reader}-{i}-", dir=work / "out"))
                    runs[reader].append(dlio(work, name, folder, out))
                    print(f"dlio_bench: {name} {reader} run {i}: {runs[reader][-1]}", flush=True)
        finally:
            # All nodes at once: each daemon serves its peers until every one has unmounted.
            umounts = [subprocess.Popen([str(FANFS), "umount", str(m)], env=ENV) for m in mnts]
            for u in umounts:
                u.wait(120)
            daemons.wait(120)
        results[name] = {
            reader: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for reader, rs in runs.items()
        }
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nDLIO 2.0.0, 2 ranks, median of {args.repeat} runs, caches dropped before each "
          f"({time.strftime('%Y-%m-%d')})")  # fmt: skip
    print("| workload | reader | samples/s | AU % | MB/s | fanfs/native (samples/s) |")
    print("|---|---|---|---|---|---|")
    for name, by in results.items():
        for reader, m in by.items():
            ratio = (
                m["samples_per_s"] / by["native"]["samples_per_s"] if reader == "fanfs" else None
            )
            print(f"| {name} | {reader} | {m['samples_per_s']:.1f} | {m['au_percent']:.1f} | "
                  f"{m['mb_per_s']:.1f} | {'' if ratio is None else f'{ratio:.2f}'} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
