"""The limits of a submission's child processes, and the environment each child starts with.

For the grader (assignments' grading): `Limits` (CPU seconds of a case, of the notebook's cells,
of the whole notebook, MiB of memory, and the wall-clock backstop of a CPU limit), what a child
may leave in its scratch folder, how many threads and oracle calls it may use, and `child_env`,
the whole environment of a child (or of the zygote): nothing of the grader's own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

SCRATCH_BYTES = 64 * 2**20  # the size of a child's scratch tmpfs (`namespaces.scratch_on_tmpfs`)
SCRATCH_FILES = 1000  # its files and folders
POLL_S = 0.1
MAX_CALLS = 5000  # oracle calls answered in one run of a case
MAX_THREADS = 64  # threads of one child: more is a bomb aimed at the machine's process table
SEND_S = 5.0  # how long the grader waits for a child to take a message
INTERRUPTED = threading.Event()
"""Set when the grading is interrupted (Ctrl-C, SIGTERM): every notebook stops at its next
check, and no child is started."""


@dataclass
class Limits:
    """Limits of one submission's children, in CPU seconds of the child (and MiB of memory).

    ``case_s`` is the limit of a case; a case that trains a model asks for more with its own
    ``Case.time_s`` and gets the larger of the two. ``cells_s`` bounds running the notebook's
    cells in each child, ``total_s`` the CPU time of all the notebook's children together. A
    limit is counted in CPU time, which a busy machine does not inflate; a child that waits
    instead of computing is stopped by a wall-clock backstop of ``wall_factor`` times the limit
    plus ``wall_extra_s``.
    """

    case_s: float = 5.0
    cells_s: float = 30.0
    total_s: float = 240.0
    memory_mb: int = 4096
    wall_factor: float = 3.0
    wall_extra_s: float = 10.0

    def wall(self, cpu_s: float) -> float:
        """The wall-clock backstop of a limit of ``cpu_s`` CPU seconds."""
        return self.wall_factor * cpu_s + self.wall_extra_s


def child_env(folder: Path) -> dict[str, str]:
    """The whole environment of a child (or of the zygote) whose folder is ``folder``."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}
