"""Execute notebooks in place, top to bottom in a fresh kernel, and print each one's run time.

    python tests/execute_notebooks.py [PATH ...]     # files or folders; default: book/
    python tests/execute_notebooks.py --time-only [PATH ...]   # time them, leave them as they are

With ``--time-only`` nothing is written: run it under the environment of another CPU
(``ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1``) to see how long
each notebook takes there.

The kernel is this interpreter, so run it with the project's virtual environment (`make execute`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebooks import ROOT, book_notebooks  # noqa: E402


def execute(path: Path, timeout: int = 300, write: bool = True) -> float:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,  # no per-cell timestamps in the stored notebook
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    if write:
        nbformat.write(nb, path)
    return elapsed


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT / "book"],
                        help="notebooks or folders of notebooks (default: book/)")
    parser.add_argument("--time-only", action="store_true",
                        help="time the notebooks and leave them as they are")
    opts = parser.parse_args(args)
    paths: list[Path] = []
    for a in opts.paths:
        p = a.resolve()
        if not p.exists():
            parser.error(f"{a}: no such file or folder")
        paths += [q for q in book_notebooks() if p == q or p in q.parents] if p.is_dir() else [p]
    for p in paths:
        print(f"{execute(p, write=not opts.time_only):6.1f} s  {p.relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
