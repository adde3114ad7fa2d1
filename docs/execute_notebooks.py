"""Execute the tutorial notebooks in place, so that the committed copies carry their outputs.

The documentation renders ``notebooks/*.ipynb`` with ``nb_execution_mode = "off"``: what it
shows is what this script stored. Run it after changing a notebook (or the code it calls)::

    python docs/execute_notebooks.py                     # every notebook, full sizes
    python docs/execute_notebooks.py 01_quickstart       # only the notebooks named
    BRAINTRACE_QUICK=1 python docs/execute_notebooks.py  # toy sizes (seconds each)

Each notebook runs top to bottom in a fresh ``python3`` kernel, with the notebook's folder as
working directory. With ipykernel installed in the project's virtual environment (the ``dev``
extra), that kernel is the interpreter that runs this script.
Its code cells get execution counts 1, 2, ... and the notebook's metadata records a hash of
its code (``braintrace.source_sha256``) and whether it ran at full or quick size;
``tests/test_docs.py`` fails when a notebook has no outputs, counts out of order, or code that
changed since it was executed; and since a notebook's outputs also depend on the library it
calls, it runs the code of each notebook at full size up to its last cell tagged
``check-output`` (cells that print what does not vary from machine to machine, such as
``learner.report()``, and that only build and compile models) and compares what those cells
print with what they store. A cell that raises stops the script with its traceback; that
notebook is left as it was (it is written only after a complete run).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import time

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
METADATA_KEY = "braintrace"


def source_sha256(notebook: nbformat.NotebookNode) -> str:
    """Hash of the notebook's code cells, in order (what its outputs were computed from)."""
    digest = hashlib.sha256()
    for cell in notebook.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode())
            digest.update(b"\0")
    return digest.hexdigest()


def execute(path: pathlib.Path, timeout: int, quick: bool) -> float:
    """Run one notebook in a fresh kernel and write it back with its outputs; seconds taken."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    env = dict(os.environ)
    if quick:
        env["BRAINTRACE_QUICK"] = "1"
    else:
        env.pop("BRAINTRACE_QUICK", None)
    start = time.perf_counter()
    client.execute(env=env)
    elapsed = time.perf_counter() - start
    notebook.metadata[METADATA_KEY] = {
        "source_sha256": source_sha256(notebook),
        "size": "quick" if quick else "full",
    }
    nbformat.write(notebook, path)
    return elapsed


def _select(names: list[str]) -> list[pathlib.Path]:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not names:
        return paths
    chosen = [p for p in paths if p.stem in names or p.name in names]
    unknown = set(names) - {p.stem for p in chosen} - {p.name for p in chosen}
    if unknown:
        known = ", ".join(p.stem for p in paths)
        raise SystemExit(f"no notebook named {sorted(unknown)} in {NOTEBOOKS}; known: {known}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: all)")
    parser.add_argument("--timeout", type=int, default=1800,
                        help="seconds allowed for one cell (default 1800)")
    args = parser.parse_args(argv)
    quick = os.environ.get("BRAINTRACE_QUICK") == "1"
    for path in _select(args.names):
        print(f"{path.name}: running ({'quick' if quick else 'full'} size)", flush=True)
        elapsed = execute(path, args.timeout, quick)  # a failing cell raises, naming itself
        print(f"{path.name}: done in {elapsed:.0f} s", flush=True)


if __name__ == "__main__":
    main()
