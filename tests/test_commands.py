"""`make lab` and `make serve` start, answer on a local port, and stop.

Each command runs as a reader would type it, on a free port of 127.0.0.1, in its own process group
so that the test can stop make and everything make started. `make lab` must also start as root (a
container, a cloud notebook), where Jupyter refuses to run unless given `--allow-root`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.book

TOKEN = "book-test-token"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """Run ``make ARGS`` in its own process group; stop the whole group on exit."""
    with log.open("w") as out:
        proc = subprocess.Popen(["make", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            yield proc
        finally:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue


def fetch(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """GET ``url`` until it answers 200 (or the command exits, or ``timeout`` seconds pass)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the command exited with {proc.returncode} before answering {url}:\n"
                        f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return r.read().decode("utf-8", "replace")
                last = f"status {r.status}"
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            last = repr(e)
        time.sleep(0.5)
    pytest.fail(f"{url} did not answer within {timeout:.0f} s (last: {last}):\n"
                f"{log.read_text()[-3000:]}")


def test_make_lab_starts_and_serves_the_notebooks(tmp_path):
    port = free_port()
    log = tmp_path / "lab.log"
    args = ["lab", f"LAB_PORT={port}",
            f"LAB_ARGS=--no-browser --ServerApp.port_retries=0 --IdentityProvider.token={TOKEN}"]
    with running(args, log) as proc:
        page = fetch(f"http://127.0.0.1:{port}/lab?token={TOKEN}", proc, log, timeout=120)
        assert "JupyterLab" in page
        listing = fetch(f"http://127.0.0.1:{port}/api/contents?token={TOKEN}", proc, log, 30)
        assert '"01_attention.ipynb"' in listing, "JupyterLab does not open in book/"
    # Run as root (as here in CI), Jupyter would have exited at once without --allow-root, and
    # fetch() would have failed with its message.


def test_make_serve_serves_the_first_chapter(built_book, tmp_path):
    assert built_book.returncode == 0
    port = free_port()
    log = tmp_path / "serve.log"
    with running(["serve", f"PORT={port}"], log) as proc:
        # `make serve` first brings the build up to date, which takes a while.
        page = fetch(f"http://127.0.0.1:{port}/book/01_attention.html", proc, log, timeout=600)
        assert "Attention from scratch" in page
        index = fetch(f"http://127.0.0.1:{port}/", proc, log, timeout=30)
        assert "url=book/intro.html" in index.lower(), "the site root does not lead to the intro"
