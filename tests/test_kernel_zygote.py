"""nbval's kernels forked from one zygote (tests/kernel_zygote.py, tests/kernel_launcher.py).

A forked kernel must behave as a fresh one for everything a notebook or nbval sees: it runs
code in the launcher's folder and environment, starts with a fresh namespace, takes an
interrupt, and goes away with its launcher (shut down or killed), leaving no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from kernel_zygote import cpu_key  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zygote") / "z.sock")
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "kernel_zygote.py"), path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=TESTS.parent,
    )
    assert proc.stdout.readline().strip() == b"ready"
    yield path
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0  # it exits when its standard input closes
    assert not os.path.exists(path)


def _start(zygote: str, folder: Path, **env: str):
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import KernelManager

    spec = KernelSpec(
        argv=[sys.executable, str(TESTS / "kernel_launcher.py"), "-f", "{connection_file}"],
        display_name="forked",
        language="python",
        env={"BOOK_KERNEL_ZYGOTE": zygote, **env},
    )
    km = KernelManager()
    km._kernel_spec = spec  # the spec above, instead of one looked up by name
    km.start_kernel(cwd=str(folder))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=30)
    return km, kc


def _run(kc, code: str, timeout: float = 30) -> tuple[str, str]:
    """Run ``code``; its standard output and the reply's status."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    return "".join(out), reply["content"]["status"]


def _kernel_pid(kc) -> int:
    out, status = _run(kc, "import os; print(os.getpid())")
    assert status == "ok"
    return int(out)


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_kernel_runs_like_a_fresh_one(zygote, tmp_path):
    km, kc = _start(zygote, tmp_path, BOOK_PROBE="yes")
    try:
        pid = _kernel_pid(kc)
        assert pid != km.provisioner.process.pid  # the kernel is not the launcher
        out, status = _run(
            kc,
            "import os, sys\n"
            "print(os.getcwd())\n"
            "print(os.environ.get('BOOK_PROBE'), "
            "'BOOK_KERNEL_ZYGOTE' in os.environ)\n"
            "print('torch' in sys.modules, 'q' in dir())\n"
            "q = 1\n",
        )
        assert status == "ok"
        assert out.splitlines() == [str(tmp_path), "yes False", "True False"]
        # An interrupt reaches the kernel through the launcher and stops a running cell.
        msg_id = kc.execute("import time; time.sleep(60)")
        time.sleep(1.0)
        start = time.monotonic()
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=20)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - start < 10
        # The same kernel goes on. (ipykernel aborts requests that reach it while it is still
        # clearing its queue after the error, fresh or forked: ask again after a moment.)
        for _ in range(5):
            answer = _run(kc, "print(q)")
            if answer[1] != "aborted":
                break
            time.sleep(0.2)
        assert answer == ("1\n", "ok")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert _gone(pid)
    assert not km.is_alive()


def test_a_second_kernel_starts_with_a_fresh_namespace(zygote, tmp_path):
    km, kc = _start(zygote, tmp_path)
    try:
        assert _run(kc, "print('q' in dir())") == ("False\n", "ok")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_killed_launcher_takes_its_kernel_with_it(zygote, tmp_path):
    km, kc = _start(zygote, tmp_path)
    pid = _kernel_pid(kc)
    kc.stop_channels()
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    assert _gone(pid)
    km.cleanup_resources()


def test_kernels_of_another_cpu_come_from_another_zygote():
    native = {"OMP_NUM_THREADS": "1"}
    generic = {**native, "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert cpu_key(native) != cpu_key(generic)
    assert cpu_key(native) == cpu_key({**native, "HOME": "/elsewhere"})


def test_without_a_zygote_the_launcher_is_an_ordinary_kernel(tmp_path):
    km, kc = _start(str(tmp_path / "no-such.sock"), tmp_path)
    try:
        assert _kernel_pid(kc) == km.provisioner.process.pid
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
