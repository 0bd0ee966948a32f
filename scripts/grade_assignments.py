"""Grade handed-in assignment notebooks with the checkers of utils.checks, without nbgrader.

    python scripts/grade_assignments.py submissions/*/*.ipynb > grades.csv

Each notebook runs top to bottom in a fresh kernel (a cell that fails does not stop the run), then
one more cell calls the assignment's checkers on the objects the student defined and reports their
scores. It prints a CSV line per notebook: path, one score per checker, and their mean.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

# Which checker grades which object, for each assignment (the notebook's file name).
CHECKS = {
    "a1_attention": {"check_scaled_dot_product_attention": "scaled_dot_product_attention"},
    "a2_multi_head_attention": {"check_multi_head_attention": "MultiHeadAttention"},
    "a3_positional_encoding_layer_norm": {"check_positional_encoding": "sinusoidal_encoding",
                                          "check_layer_norm": "LayerNorm"},
    "a4_encoder_layer": {"check_encoder_layer": "EncoderLayer"},
}

GRADER_CELL = """
import json as _json
from utils import checks as _checks
_scores = {{}}
for _check, _name in {pairs!r}.items():
    _obj = globals().get(_name)
    _scores[_check] = 0.0 if _obj is None else getattr(_checks, _check)(_obj, verbose=False).score
print("GRADES " + _json.dumps(_scores))
"""


def grade(path: Path, timeout: int = 300) -> dict[str, float]:
    """Run the notebook at ``path`` and return {checker name: score from 0 to 1}."""
    pairs = CHECKS[path.stem]
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(GRADER_CELL.format(pairs=pairs)))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except Exception:  # a cell that hangs past the timeout, a kernel that dies: no marks
        return dict.fromkeys(pairs, 0.0)
    for out in nb.cells[-1].outputs:
        for line in out.get("text", "").splitlines():
            if line.startswith("GRADES "):
                return json.loads(line[len("GRADES "):])
    return dict.fromkeys(pairs, 0.0)


def main(paths: list[str]) -> int:
    writer = csv.writer(sys.stdout)
    writer.writerow(["notebook", "scores", "mean"])
    for p in map(Path, paths):
        if p.stem not in CHECKS:
            print(f"skipping {p}: not an assignment of the book", file=sys.stderr)
            continue
        scores = grade(p)
        mean = sum(scores.values()) / len(scores)
        writer.writerow([str(p), " ".join(f"{k}={v:.2f}" for k, v in scores.items()),
                         f"{mean:.2f}"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
