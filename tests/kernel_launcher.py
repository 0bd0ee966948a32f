"""The kernel that nbval starts, when notebook kernels are forked (see `kernel_zygote`).

Jupyter starts this small script as if it were the kernel: ``python kernel_launcher.py -f
CONNECTION_FILE``. It imports nothing heavy. It asks the zygote whose socket is named in
``BOOK_KERNEL_ZYGOTE`` for a kernel, handing over the connection file, its folder, its
environment and its standard streams, and then stands in for the kernel: a signal that Jupyter
sends it (an interrupt, a terminate) is passed on to the kernel, and it exits when the kernel
exits. Two pipes tie the two processes together: the kernel holds the write end of one, so the
launcher sees end-of-file when the kernel is gone; the launcher holds the write end of the
other, so the kernel sees end-of-file, and exits, when the launcher is killed.

Without a zygote (``BOOK_KERNEL_ZYGOTE`` unset, or the zygote gone) it becomes an ordinary
ipykernel in this process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def _ordinary_kernel() -> None:
    from ipykernel.kernelapp import launch_new_instance

    launch_new_instance()


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def main(argv: list[str]) -> int:
    path = os.environ.get("BOOK_KERNEL_ZYGOTE")
    sock = _connect(path) if path else None
    if sock is None:
        _ordinary_kernel()
        return 0
    to_kernel_r, to_kernel_w = os.pipe()  # the kernel reads: end-of-file = the launcher is gone
    from_kernel_r, from_kernel_w = os.pipe()  # the kernel holds the write end until it exits
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(sock, [request], [0, 1, 2, to_kernel_r, from_kernel_w])
    os.close(to_kernel_r)
    os.close(from_kernel_w)
    answer = sock.recv(4096)
    sock.close()
    pid = json.loads(answer or b"{}").get("pid")
    if not pid:
        print("the kernel zygote did not start a kernel", file=sys.stderr)
        return 1

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    while True:
        try:
            if not os.read(from_kernel_r, 1):
                return 0  # every copy of the write end closed: the kernel has exited
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
