"""Regenerates the main job's output that README.md quotes, in one command.

From the repository root, in the project's virtual environment::

    python benchmarks/readme_main_job.py        # about a minute on a 2-core CPU

It runs ``python -m braintrace`` and ``python -m braintrace --quick``, each in a fresh
process on the CPU with XLA's default flags (:func:`main_job_env`), in a temporary folder
(the plots go there), and rewrites what ``README.md`` holds between the lines
:data:`BEGIN` and :data:`END` in its "Two commands" section: both runs' output from the
table on, with their wall-clock and CPU times. Nothing else of the README changes.

``tests/test_main.py`` runs the ``--quick`` job again (in the test process, with the suite's
XLA flags: the same accuracy and loss, memory within a few hundred bytes) and compares its table
and sentences with the quoted ones, every number but the times; it also compiles the full run's
train steps and checks their memory and data columns, and checks both runs' sentences against
their tables. So after a change that moves those numbers the test fails until this script is
run again and the README committed. The full run's accuracy and loss are not checked: 40 Adam
updates of a spiking network amplify the last bit of a rounding, which another CPU or another
XLA may round differently.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN = ("<!-- main-job output: written by `python benchmarks/readme_main_job.py`; "
         "tests/test_main.py checks it -->")
END = "<!-- /main-job output -->"
COMMAND = [sys.executable, "-m", "braintrace"]
TABLE_START = re.compile(r"^ +T  method")


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
    """The part of the main job's output the README quotes: from the table's header on."""
    lines = stdout.rstrip("\n").splitlines()
    start = next(i for i, line in enumerate(lines) if TABLE_START.match(line))
    return "\n".join(lines[start:])


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} minutes"


def block(full: tuple[str, float, float], quick: tuple[str, float, float]) -> str:
    """The README's lines between :data:`BEGIN` and :data:`END`."""
    first = (f"On a {os.cpu_count()}-core CPU `python -m braintrace` took {_seconds(full[1])} "
             f"({_seconds(full[2])} of CPU time) and printed (its progress bars go to stderr; "
             "`tests/test_main.py` compiles the train steps at these sizes and checks the memory "
             "and data columns):")
    second = (f"`python -m braintrace --quick` took {_seconds(quick[1])} ({_seconds(quick[2])} "
              "of CPU time); `tests/test_main.py` runs it again and checks every number it "
              "prints but the times against these lines:")
    return "\n".join([BEGIN, textwrap.fill(first, width=100), "", "```", quoted(full[0]), "```",
                      "", textwrap.fill(second, width=100), "", "```", quoted(quick[0]), "```",
                      END])


def replace_block(text: str, new_block: str) -> str:
    """``text`` with the lines from :data:`BEGIN` to :data:`END` replaced by ``new_block``."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{README} has no block between {BEGIN!r} and {END!r}")
    return text[:begin] + new_block + text[end + len(END):]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=pathlib.Path, default=README,
                        help="the file to rewrite (default: the repository's README.md)")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    replace_block(text, "")  # the markers are there: fail before a minute of running
    with tempfile.TemporaryDirectory() as folder:
        full = run([], folder)
        quick = run(["--quick"], folder)
    args.readme.write_text(replace_block(text, block(full, quick)))
    print(f"{args.readme}: the main job's output rewritten (full run {_seconds(full[1])}, "
          f"--quick {_seconds(quick[1])})")


if __name__ == "__main__":
    main()
