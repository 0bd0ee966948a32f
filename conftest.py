"""How `make test` runs everything in one pytest session on two workers.

The README's test command runs, at once: the unit tests, every notebook under nbval, every
notebook again as another CPU would run it, and the built book in a browser. pytest-xdist hands
each worker one *group* at a time (``--dist loadscope``, with the groups of this file's scheduler),
and this file decides the groups and their order:

* every test module is one group (its module-scoped fixtures, such as a grading run, are then
  made once, on one worker), every notebook is one group (nbval runs a notebook's cells in order,
  in one kernel), and the tests of the built book are one group (the book is built once, then
  visited by one browser);
* ``--nbval-cpu both`` collects every notebook a second time (``generic``: only that time), as a
  group of its own whose kernel starts with PyTorch's generic kernels (no AVX2 or AVX-512) and
  MKL limited to SSE4.2, so that float sums happen in another order: a stored output that
  depends on that order fails here instead of on a reader's laptop;
* every notebook's kernel is forked from a zygote that has imported torch once (``--nbval-kernels
  forked``, the default; tests/kernel_zygote.py), one per worker and per kind of CPU, instead of
  a fresh Python that spends seconds importing it (and so is the kernel of a test that runs a
  notebook itself, through the ``notebook_kernel_manager`` fixture);
* the groups are queued longest first (the book, then the notebooks, slowest first, then the
  test modules), so that no worker is left with a long group while the other one idles.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Environment of a kernel that computes as another CPU would (see CONVENTIONS: "Every notebook").
GENERIC_CPU_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
# Appended to a notebook's node id for its second run. Neither "@" nor "]" may appear in a node id
# that pytest-xdist groups ("@" separates the group's name, "]" ends a parameter).
GENERIC_SUFFIX = "+generic-cpu"
# The modules of the tests that use the built book (the `built_book` fixture): one group, so that
# the book is built once, into one folder, and visited by one browser. Such a test elsewhere stops
# the run (see pytest_collection_modifyitems).
BOOK_TEST_MODULES = (
    "tests/test_book.py", "tests/test_browser.py", "tests/test_browser_explorer.py",
    "tests/test_browser_search.py", "tests/test_commands.py",
)

# Notebooks that take longest, first (measured with `make execute`); the rest follow in the
# order they are collected. Only the order of the queue depends on this list, never a result.
SLOWEST_NOTEBOOKS = (
    "09_transformer", "10_model_families", "07_layer_norm_and_residuals",
    "12_images_and_convolution", "15_tokens_and_real_text", "18_choosing_the_next_token",
    "19_fine_tuning", "20_lora_and_preferences",
    "11_attention_beyond_text", "17_devices_and_precision", "13_fast_attention",
    "16_beyond_one_machine", "21_published_checkpoints", "14_real_models",
    "a8_train",
    "08_encoder", "05_positional_encoding", "06_feed_forward",
)
# Test modules that train a chapter's model (tens of seconds): queued with the slowest
# notebooks' group, so that no worker is left with one at the end.
SLOW_TEST_MODULES: tuple[str, ...] = ()  # none at present; paths as "tests/test_x.py"


def pytest_addoption(parser):
    parser.addoption(
        "--nbval-kernels", choices=("forked", "fresh"), default="forked",
        help="with --nbval --nbval-current-env: fork each notebook's kernel from a process that "
             "has imported torch once (forked, the default; tests/kernel_zygote.py), or start "
             "each kernel afresh (fresh)",
    )
    parser.addoption(
        "--nbval-cpu", choices=("native", "generic", "both"), default="native",
        help="with --nbval: run the notebooks on this CPU's kernels (native, the default), on "
             "PyTorch's generic kernels as another CPU would (generic), or both",
    )


def _generic_notebook_class():
    from nbval.plugin import IPyNbFile

    class GenericCpuNotebook(IPyNbFile):
        """A notebook whose kernel starts with `GENERIC_CPU_ENV` (and nothing else changed)."""

        def setup(self):
            saved = {k: os.environ.get(k) for k in GENERIC_CPU_ENV}
            os.environ.update(GENERIC_CPU_ENV)
            try:
                super().setup()  # starts the kernel, which copies the environment now
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

    return GenericCpuNotebook


def pytest_collect_file(file_path: Path, parent):
    opt = parent.config.option
    if file_path.suffix == ".ipynb" and opt.nbval and opt.nbval_cpu != "native":
        cls = _generic_notebook_class()
        name = file_path.name + GENERIC_SUFFIX
        nodeid = f"{parent.nodeid}/{name}" if parent.nodeid else name
        return cls.from_parent(parent, path=file_path, name=name, nodeid=nodeid)
    return None


class _KernelZygotes:
    """One `kernel_zygote` per environment of torch's kernels (`cpu_key`), started when a
    notebook first needs it and stopped with the session."""

    def __init__(self) -> None:
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="kernels-"))
        self.running: dict[str, tuple[object, str | None]] = {}

    def socket_for(self, env: dict[str, str]) -> str | None:
        """The socket of the zygote for ``env``, started now if need be; None if it fails
        (the kernel then starts afresh)."""
        import selectors
        import subprocess

        from kernel_zygote import cpu_key

        key = cpu_key(env)
        if key not in self.running:
            path = str(self.folder / f"zygote{len(self.running)}.sock")
            proc = subprocess.Popen([sys.executable, str(TESTS / "kernel_zygote.py"), path],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                    cwd=TESTS.parent)
            # "ready" once it has imported torch and listens; a zygote that says nothing for
            # two minutes is stopped, and the kernels start afresh.
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                ready = bool(sel.select(120)) and proc.stdout.readline().strip() == b"ready"
            if not ready:
                proc.kill()
            self.running[key] = (proc, path if ready else None)
        return self.running[key][1]

    def stop(self) -> None:
        import shutil
        import subprocess

        for proc, _ in self.running.values():
            proc.stdin.close()  # the zygote exits when its standard input closes
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


TESTS = Path(__file__).resolve().parent / "tests"
_ZYGOTES: list[_KernelZygotes] = []


def pytest_configure(config):
    """With --nbval --nbval-current-env (and --nbval-kernels forked, the default, on Linux),
    nbval's kernels are forked from a zygote (tests/kernel_zygote.py): the kernel that Jupyter
    starts is tests/kernel_launcher.py, which asks the zygote for the real one."""
    opt = config.option
    if not (getattr(opt, "nbval", False) and getattr(opt, "nbval_current_env", False)) \
            or opt.nbval_kernels != "forked" or not sys.platform.startswith("linux"):
        return
    from nbval import kernel as nbval_kernel

    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    zygotes = _KernelZygotes()
    _ZYGOTES.append(zygotes)
    original = nbval_kernel.NbvalKernelspecManager.get_kernel_spec

    def get_kernel_spec(self, kernel_name):
        spec = original(self, kernel_name)
        if kernel_name == nbval_kernel.CURRENT_ENV_KERNEL_NAME:
            path = zygotes.socket_for(dict(os.environ))
            if path:
                spec.argv = [sys.executable, str(TESTS / "kernel_launcher.py"),
                             "-f", "{connection_file}"]
                spec.env = {**spec.env, "BOOK_KERNEL_ZYGOTE": path}
        return spec

    nbval_kernel.NbvalKernelspecManager.get_kernel_spec = get_kernel_spec


@pytest.fixture
def notebook_kernel_manager():
    """For a test that runs a notebook itself (`nbclient.NotebookClient(nb, km=...)`): a kernel
    manager whose kernel is forked from this worker's zygote, as nbval's are, or None (a fresh
    kernel) when no zygote runs (without ``--nbval``, or with ``--nbval-kernels fresh``)."""
    path = _ZYGOTES[0].socket_for(dict(os.environ)) if _ZYGOTES else None
    if path is None:
        yield None
        return
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class ForkedSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            spec = super().get_kernel_spec(kernel_name)
            spec.argv = [sys.executable, str(TESTS / "kernel_launcher.py"), "-f",
                         "{connection_file}"]
            spec.env = {**spec.env, "BOOK_KERNEL_ZYGOTE": path}
            return spec

    yield AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ForkedSpecs())


def pytest_unconfigure(config):
    while _ZYGOTES:
        _ZYGOTES.pop().stop()


def _rank(item: pytest.Item) -> tuple[int, int]:
    """Where an item's group goes in the queue: the book, the slow test modules and the
    notebooks (slowest first), the other test modules."""
    if _module(item.nodeid) in BOOK_TEST_MODULES:
        return (0, 0)
    if _module(item.nodeid) in SLOW_TEST_MODULES:
        return (1, 0)
    path = Path(str(item.path))
    if path.suffix == ".ipynb":
        known = SLOWEST_NOTEBOOKS
        return (1, known.index(path.stem) if path.stem in known else len(known))
    return (2, 0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With ``--nbval-cpu generic``, leave out the notebooks' native run. On a pytest-xdist
    worker, queue the groups longest first (the controller hands them out in the order the
    workers collected them)."""
    if config.option.nbval_cpu == "generic":
        native = [i for i in items if i.path.suffix == ".ipynb"
                  and not _module(i.nodeid).endswith(GENERIC_SUFFIX)]
        if native:
            config.hook.pytest_deselected(items=native)
            left_out = set(native)
            items[:] = [i for i in items if i not in left_out]
    if not hasattr(config, "workerinput"):
        return
    strays = {_module(i.nodeid) for i in items if "built_book" in getattr(i, "fixturenames", ())
              and _module(i.nodeid) not in BOOK_TEST_MODULES}
    if strays:
        raise pytest.UsageError(f"add these modules, which use built_book, to BOOK_TEST_MODULES "
                                f"in conftest.py: {sorted(strays)}")
    items.sort(key=_rank)  # stable: within a group, and among equals, collection order stays


def _module(nodeid: str) -> str:
    """The test module or the notebook (native or generic CPU) of a node id."""
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadscope``, hand out whole groups: a test module, a notebook, or all the
    book tests together. (pytest-xdist's ``loadgroup`` marks cannot do it: it renames nodes by
    an attribute that pytest 9 no longer reads.)"""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "book" if module in BOOK_TEST_MODULES else module

    return GroupScheduling(config, log)


# ---------------------------------------------------------------------------------------------
# Where the time goes: each group's time (setup, call and teardown of its tests), summed.
_GROUP_SECONDS: dict[str, float] = {}
TIMES_FILE = Path(__file__).resolve().parent / "test-artifacts" / "test-times.json"


def pytest_runtest_logreport(report):
    """Runs where the report is made and, under pytest-xdist, again in the controller."""
    group = _module(report.nodeid)
    _GROUP_SECONDS[group] = _GROUP_SECONDS.get(group, 0.0) + float(report.duration or 0.0)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not _GROUP_SECONDS:
        return
    import json

    ranked = sorted(_GROUP_SECONDS.items(), key=lambda kv: -kv[1])
    total = sum(_GROUP_SECONDS.values())
    TIMES_FILE.parent.mkdir(exist_ok=True)
    TIMES_FILE.write_text(json.dumps(dict(ranked), indent=1) + "\n", encoding="utf-8")
    terminalreporter.write_line(
        f"time by group: {total:.0f} s over {len(ranked)} groups (summed over workers); "
        "the slowest: "
        + ", ".join(f"{g} {s:.0f} s" for g, s in ranked[:8])
        + f" (all in {TIMES_FILE.relative_to(TIMES_FILE.parent.parent)})")
