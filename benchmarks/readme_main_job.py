"""Runs the main job for the README and records its output, in one command.

From the repository root, in the project's virtual environment::

    python benchmarks/readme_main_job.py        # about a minute on a 2-core CPU

It runs ``python -m braintrace`` and ``python -m braintrace --quick``, each in a fresh
process on the CPU with XLA's default flags (:func:`main_job_env`), in a temporary folder
(the plots go there), writes both runs' output with their wall-clock and CPU times to
``benchmarks/results/main_job.json``, and renders the pages' tables again
(``render_tables.py``): the README's main-job block and the docs' main-job page.

``tests/test_main.py`` runs the ``--quick`` job again (in the test process, with the suite's
XLA flags: the same accuracy and loss, memory within a few hundred bytes) and compares its table
and sentences with the recorded ones, every number but the times; it also compiles the full run's
train steps and checks their memory and data columns, and checks both runs' sentences against
their tables. So after a change that moves those numbers the test fails until this script is
run again and the JSON and pages committed. The full run's accuracy and loss are not checked: 40
Adam updates of a spiking network amplify the last bit of a rounding, which another CPU or
another XLA may round differently.

So that the full run's numbers cannot go stale either, the JSON records a fingerprint of the
sources that print them (:func:`sources_fingerprint`: every Python file of ``braintrace/`` and
``layers/``, the main job among them, and this script), and ``tests/test_main.py`` fails while
the committed fingerprint is not the current sources'. A change to those files is finished by
running this script (on a quiet machine) and committing the JSON and the pages with it; the
fingerprint is of the bytes, so even a docstring's change asks for a new record, whose numbers
then say exactly which sources printed them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "main_job.json"
COMMAND = [sys.executable, "-m", "braintrace"]
TABLE_START = re.compile(r"^ +T  method")
SOURCES = ("braintrace", "layers", "benchmarks/readme_main_job.py")
"""What the main job's numbers are a function of (with the machine and the dependencies): the
library and its layers (``braintrace/__main__.py`` is the job, its sizes in ``FULL`` and
``QUICK``), and this script (the environment it runs the job in)."""


def sources_fingerprint(root: pathlib.Path = ROOT) -> str:
    """SHA-256 of every Python file of :data:`SOURCES` under ``root``: its path and bytes.

    Example:
        >>> len(sources_fingerprint())
        64
    """
    digest = hashlib.sha256()
    files = []
    for source in SOURCES:
        path = root / source
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def main_job_env() -> dict[str, str]:
    """The environment the quoted runs use: this one on the CPU, with XLA's defaults.

    ``XLA_FLAGS`` and ``JAX_DISABLE_MOST_OPTIMIZATIONS`` (which the test suite sets to
    compile faster) change XLA's fusions, hence the memory and the rounding of the
    numbers; they are removed.
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for name in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS", "SUITE_XLA_FLAGS"):
        env.pop(name, None)
    return env


def run(options: list[str], cwd: str) -> tuple[str, float, float]:
    """``python -m braintrace *options`` in ``cwd``: stdout, wall seconds, CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([*COMMAND, *options], capture_output=True, text=True, cwd=cwd,
                            env=main_job_env(), check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        raise SystemExit(f"python -m braintrace {' '.join(options)} failed:\n"
                         f"{result.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result.stdout, wall, cpu


def quoted(stdout: str) -> str:
    """The part of the main job's output the pages quote: from the table's header on."""
    lines = stdout.rstrip("\n").splitlines()
    start = next(i for i, line in enumerate(lines) if TABLE_START.match(line))
    return "\n".join(lines[start:])


def record(full: tuple[str, float, float], quick: tuple[str, float, float]) -> dict:
    """What ``main_job.json`` holds: each run's output from its table on, and its times."""
    from _models import library_state

    def run(result: tuple[str, float, float], options: str) -> dict:
        stdout, wall, cpu = result
        return {"command": f"python -m braintrace{options}", "output": quoted(stdout),
                "wall_s": wall, "cpu_s": cpu}

    return {"benchmark": "main_job",
            "environment": {"braintrace": library_state(), "backend": "cpu",
                            "cpu_count": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()},
            "sources_sha256": sources_fingerprint(),
            "runs": {"full": run(full, ""), "quick": run(quick, " --quick")}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RECORD,
                        help="the JSON to write (default: benchmarks/results/main_job.json)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        full = run([], folder)
        quick = run(["--quick"], folder)
    args.out.write_text(json.dumps(record(full, quick), indent=2) + "\n")
    print(f"{args.out}: the main job's output (full run {full[1]:.0f} s, --quick "
          f"{quick[1]:.0f} s)")
    if args.out == RECORD:
        import render_tables

        render_tables.main([])


if __name__ == "__main__":
    main()
