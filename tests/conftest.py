import sys
from pathlib import Path

# Let tests import the helper modules that sit beside them (tests/notebooks.py, ...).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import subprocess  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
# One-line summaries that tests ask to print at the end of the run (the browser test's counts).
SUMMARY_LINES = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in config.stash.get(SUMMARY_LINES, []):
        terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    """On a pytest-xdist worker, hand the summary lines to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["summary_lines"] = session.config.stash.get(SUMMARY_LINES, [])


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: only called when it runs the tests
def pytest_testnodedown(node, error):
    lines = getattr(node, "workeroutput", {}).get("summary_lines", [])
    node.config.stash.setdefault(SUMMARY_LINES, []).extend(lines)


@pytest.fixture(scope="session")
def built_book():
    """Build the book once per test session, as `make book` does; returns the build's result."""
    jb = Path(sys.executable).parent / "jupyter-book"
    proc = subprocess.run(
        # --all: an incremental build leaves unchanged pages with a stale sidebar and stale
        # next/previous links after _toc.yml changes (the browser test then fails).
        [str(jb), "build", ".", "-W", "-n", "--keep-going", "--all"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    return proc
