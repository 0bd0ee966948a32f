"""Notebook kernels forked from one process that has already imported torch: nbval's kernels.

Every notebook under nbval used to start its own Python, which spent 3 to 4 s importing
ipykernel, torch and matplotlib before the notebook's first cell ran; with 23 notebooks each run
twice (this CPU's kernels and the generic ones), that was about a tenth of the test command's
work. This process imports them once (`PRELOAD`), runs no computation, and forks a kernel
for each request from `kernel_launcher` (the program that Jupyter starts as the kernel).

What a forked kernel has that a fresh one would not: the modules of `PRELOAD`, already imported
as a fresh kernel's first cell would import them, and nothing else. Before it starts the kernel
it takes the launcher's folder, environment and standard streams, a session of its own, the
default signal handlers, and new seeds for Python's and NumPy's global generators (as a fresh
process draws them). Nothing in torch has run yet, so no thread pool exists at the fork and the
environment that chooses torch's kernels (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``,
``OMP_NUM_THREADS``) is the one this process started with: `conftest` starts one zygote per
such environment (this CPU's kernels, the generic ones) and the launcher asks the right one.

Run as ``python kernel_zygote.py SOCKET``: it listens on the Unix socket SOCKET, prints
``ready`` when it does, and exits when its parent dies or its standard input closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import selectors
import signal
import socket
import sys
import threading

PRELOAD = (
    "numpy",
    "torch",
    "torch.nn",
    "matplotlib",
    "matplotlib.figure",
    "matplotlib.pyplot",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    # Imported by the first optimizer a notebook makes (about 1.6 s), in most chapters.
    "torch._dynamo",
)
PR_SET_PDEATHSIG = 1
# The variables that choose torch's kernels: read when torch is imported or first runs, so a
# kernel must come from a zygote started with the same values.
CPU_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


def cpu_key(env: dict[str, str]) -> str:
    """The values of `CPU_VARIABLES` in ``env``, as one string."""
    return ";".join(f"{k}={env.get(k, '')}" for k in CPU_VARIABLES)


def _preload() -> None:
    # ipykernel sets this before a kernel's first cell, unless it is set already; matplotlib
    # reads it when it is imported, which here happens before the kernel starts.
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for name in PRELOAD:
        __import__(name)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _watch(fd: int) -> None:
    """Exit as soon as the launcher is gone (end-of-file on its pipe)."""
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os._exit(1)


def _become_kernel(request: dict, fds: list[int], closing: list) -> None:
    """In the forked child: take the launcher's place, then run ipykernel; never returns."""
    try:
        os.setsid()
        for item in closing:
            item.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip((0, 1, 2), fds[:3], strict=True):
            os.dup2(fd, target)
            os.close(fd)
        lifeline, _held_until_exit = fds[3], fds[4]
        os.chdir(request["cwd"])
        env = dict(request["env"])
        env.pop("BOOK_KERNEL_ZYGOTE", None)
        os.environ.clear()
        os.environ.update(env)
        random.seed()
        import numpy as np

        np.random.seed()  # noqa: NPY002 - the legacy global generator, as a fresh process seeds it
        threading.Thread(target=_watch, args=(lifeline,), daemon=True).start()
        sys.argv = ["ipykernel_launcher", *request["argv"]]
        # ipykernel reads these two when it is imported (here, before the launcher's
        # environment arrived): the process that started the kernel, and Windows' interrupt.
        for variable, trait in (
            ("JPY_PARENT_PID", "parent_handle"),
            ("JPY_INTERRUPT_EVENT", "interrupt"),
        ):
            if env.get(variable):
                sys.argv.append(f"--IPKernelApp.{trait}={int(env[variable])}")
        from ipykernel.kernelapp import launch_new_instance

        launch_new_instance()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)


def _serve(server: socket.socket) -> None:
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ, "server")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the test session has ended
                continue
            conn, _ = server.accept()
            with conn:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 5)
                try:
                    request = json.loads(msg)
                    if len(fds) != 5:
                        raise ValueError(f"expected 5 descriptors, got {len(fds)}")
                    pid = os.fork()
                    if pid == 0:
                        _become_kernel(request, fds, [server, conn, sel])
                    answer = {"pid": pid}
                except (ValueError, KeyError, OSError) as err:
                    answer = {"error": str(err)}
                finally:
                    for fd in fds:
                        os.close(fd)
                conn.sendall(json.dumps(answer).encode())


def main(path: str) -> None:
    _die_with_parent()
    # Forked kernels are reaped at once; each kernel sets this back to the default.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    try:
        _serve(server)
    finally:
        server.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


if __name__ == "__main__":
    main(sys.argv[1])
