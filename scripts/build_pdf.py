"""The book as one PDF, through LaTeX: the build step of `make pdf` (tests/test_pdf.py then
checks the result).

1. Debian's TeX is installed if missing (`make pdf-deps`), in the background, while
2. Sphinx writes the LaTeX (`jupyter-book build --builder latex`), which needs no TeX; then
3. latexmk runs XeLaTeX until the cross-references settle (each pass writes only XeTeX's own
   .xdv, xdvipdfmx turns the last one into the PDF once), with xindy for the index.

Each step is timed. Any Sphinx warning, undefined reference or citation, or character missing
from the fonts fails the build, and a failure prints its cause first (Sphinx's warnings, the
LaTeX error with the line it stopped at, the undefined references), then where the full logs
are.

Usage: scripts/build_pdf.py [--out _build/pdf]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "the-tested-transformer.pdf"
# Jupyter Book's LaTeX class loads the bbm package, which Debian ships only in
# texlive-fonts-extra (1.4 GB); the book never uses it, so unless a real one is installed a
# one-line stand-in goes on TEXINPUTS.
BBM_STANDIN = (
    "\\ProvidesPackage{bbm}\n"
    "\\RequirePackage{amssymb}\\providecommand{\\mathbbm}[1]{\\mathbb{#1}}\n"
)
SPHINX_PROBLEM = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Error:|Exception")
LATEXMK_PROBLEM = re.compile(
    r"undefined|Latex failed|gave return code|Missing character|failed to resolve|Error",
    re.IGNORECASE,
)


def _seconds(start: float) -> str:
    return f"{time.monotonic() - start:.0f} s"


def latex_errors(log: str, context: int = 4) -> list[str]:
    """The errors of a LaTeX log ("! ..." lines), each with the lines that say where."""
    lines = log.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("!"):
            found.append("\n".join(lines[i : i + 1 + context]))
    return found


def sphinx_problems(output: str) -> list[str]:
    """Sphinx's warnings and errors, without the colour codes of its terminal output."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    return [line for line in plain.splitlines() if SPHINX_PROBLEM.search(line)]


def latexmk_problems(output: str) -> list[str]:
    return [line for line in output.splitlines() if LATEXMK_PROBLEM.search(line)]


def fail(cause: list[str], logs: list[Path], tail: str = "") -> None:
    """Print the cause first, then the end of the output and the logs to read."""
    print("make pdf FAILED. The cause:", file=sys.stderr)
    print("\n".join(cause[:30]) or "(no error line found: see the logs)", file=sys.stderr)
    if tail:
        print("\nThe end of its output:\n" + "\n".join(tail.splitlines()[-8:]), file=sys.stderr)
    print("\nFull logs: " + ", ".join(str(p.relative_to(ROOT)) for p in logs), file=sys.stderr)
    sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "pdf")
    out = parser.parse_args().out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    texinputs = out / "texinputs"
    texinputs.mkdir(parents=True)
    latex_dir = out / "_build" / "latex"
    deps_log, sphinx_log, latex_log = out / "pdf-deps.log", out / "sphinx.log", out / "latex.log"
    started = time.monotonic()

    with deps_log.open("w") as log:
        deps = subprocess.Popen(
            ["make", "--no-print-directory", "pdf-deps"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    sphinx = subprocess.run(
        [
            str(jupyter_book),
            "build",
            ".",
            "--builder",
            "latex",
            "--path-output",
            str(out),
            "-W",
            "-n",
            "--keep-going",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    sphinx_log.write_text(sphinx.stdout + sphinx.stderr)
    print(f"Sphinx wrote the LaTeX in {_seconds(started)}", flush=True)
    waited = time.monotonic()
    deps_rc = deps.wait()
    installed = deps_log.read_text().strip().splitlines()[:1] or ["already installed"]
    print(f"TeX ready {_seconds(waited)} later ({installed[0]})")
    if deps_rc != 0:
        fail(deps_log.read_text().splitlines()[-20:], [deps_log])
    if sphinx.returncode != 0:
        fail(
            sphinx_problems(sphinx.stdout + sphinx.stderr),
            [sphinx_log],
            sphinx.stdout + sphinx.stderr,
        )

    if subprocess.run(["kpsewhich", "bbm.sty"], capture_output=True).returncode != 0:
        (texinputs / "bbm.sty").write_text(BBM_STANDIN)
    env = {
        **os.environ,
        "TEXINPUTS": f"{texinputs}//:",
        "LATEXOPTS": "-interaction=nonstopmode -halt-on-error",
        "XINDYOPTS": "-L english -C utf8 -M sphinx.xdy",
    }
    latex_started = time.monotonic()
    latexmk = subprocess.run(
        ["latexmk", "-xelatex", "-Werror", "-silent", "-time", "book.tex"],
        cwd=latex_dir,
        capture_output=True,
        text=True,
        env=env,
        errors="replace",
    )
    latex_log.write_text(latexmk.stdout + latexmk.stderr)
    # latexmk -time: "'xelatex': time = 24.85" for each rule it ran, in order.
    steps = re.findall(r"^'([^']+)': time = ([\d.]+)", latexmk.stdout, re.MULTILINE)
    if latexmk.returncode != 0:
        tex_log = latex_dir / "book.log"
        log = tex_log.read_text(errors="replace") if tex_log.is_file() else ""
        # A LaTeX error stops the pass, and the references it left undefined are only noise.
        cause = latex_errors(log) or latexmk_problems(latexmk.stdout + latexmk.stderr)
        fail(cause, [latex_log, tex_log], latexmk.stdout + latexmk.stderr)
    shutil.copy(latex_dir / "book.pdf", out / TARGET)
    print(
        f"LaTeX in {_seconds(latex_started)}: "
        + ", ".join(f"{rule.split()[0]} {float(t):.0f} s" for rule, t in steps)
    )
    print(f"The PDF built in {_seconds(started)}")
    print(f"The PDF is {(out / TARGET).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
