"""The library's shape: small modules, small classes, and imports that go one way only.

CONTRIBUTING.md explains the layers; this file keeps them true. A module that grows past its
limit, or a piece that starts importing a stack, fails here with the place to look at.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from notebooks import ROOT

UTILS = ROOT / "utils"
GRADER = ROOT / "grader"  # the assignments' grader, a package of its own beside the library
MODULE_LINES = 500  # any module of the library
CHECKER_LINES = 400  # any module of the checkers (utils/checks/) or of the grader (grader/)
PACKAGES = ("utils", "grader")  # the imports that this file follows
CLASS_LINES = 120  # any class, from its first decorator to its last line

# Each module of the library sits on one level and imports only from its own level or below.
LEVELS = {
    # foundations: argument checks, comparisons, glue, the seed
    "utils": 0, "utils._validation": 0, "utils.compare": 0, "utils.glue": 0,
    "utils.devices": 0,  # where the code runs and in what precision: device(), to_device()
    # pieces (chapters 1-7, 11-13): each is one idea, proved equal to PyTorch's
    "utils.convert": 1, "utils.masks": 1, "utils.attention": 1, "utils.kv_cache": 1,
    "utils.fast_attention": 1, "utils.positional": 1, "utils.layers": 1, "utils.data": 1,
    "utils.corpus": 1,  # the book's prose, frozen, as a corpus (chapters 15, 18 to 21)
    "utils.convolution": 1, "utils.graph": 1, "utils.audio": 1,
    "utils.tokenizer": 1,  # byte-level BPE, proved equal to Hugging Face tokenizers
    "utils.tokenizer_json": 1,  # tokenizer.json (byte level, Metaspace), Llama 3's chat format
    "utils.sentencepiece_model": 1,  # SentencePiece's .model files, its BPE by hand
    "utils.ngram": 1,  # the interpolated n-gram baseline of chapter 15
    "utils.rope_scaling": 1,  # scaled RoPE frequencies of long-context checkpoints (chapter 14)
    "utils.schedules": 1,  # learning-rate schedules (chapters 7, 9), re-exported by utils.train
    # layers and stacks (chapters 8-9), made of pieces
    "utils.transformer_layers": 2, "utils.transformer": 2,
    # models and what uses them: tasks, training, decoding, counts, figures (chapters 9 on)
    "utils.models": 3, "utils.vision": 3, "utils.tasks": 3, "utils.train": 3,
    "utils.decoding": 3, "utils.costs": 3, "utils.plotting": 3, "utils.explorer": 3,
    "utils.diagrams": 3,
    "utils.decoding_plan": 3,  # decoding's step for the library's own models, checked once
    "utils.decoding_steps": 3,  # what a decoding loop reads back from the device, grouped
    "utils.checkpoint_models": 3, "utils.pretrained": 3,  # GPT-2 and Llama checkpoints
    "utils.checkpoint_io": 3,  # reading them onto any device, built on meta
    "utils.checkpoint_fields": 3,  # their config.json checked against their tensors
    "utils.family_parts": 3,  # the pieces Mistral, Qwen2, Qwen3, Gemma add to Llama's
    "utils.families": 3,  # their loaders, load_checkpoint, FAMILY_CHANGES (issue 47)
    "utils.distributed": 3,  # ranks, tensor and sequence parallelism (chapter 16)
    "utils.sampling": 1,  # temperature, top-k, top-p, min-p, repetition penalty (chapter 18)
    "utils.beam_search": 3, "utils.checkpoint_write": 3,  # beam search; save_gpt2 (chapter 18)
    "utils.lora": 3, "utils.preference": 3,  # LoRA adapters and the DPO loss (chapter 20)
    "utils.finetune": 3,  # classification head and answer-only loss (chapter 19)
}
LEVEL_NAMES = ["foundations", "pieces", "layers and stacks", "models and tools", "the checkers",
               "the grader"]


def _modules() -> list[Path]:
    """Every module of the library and of the grader."""
    return sorted(UTILS.rglob("*.py")) + sorted(GRADER.rglob("*.py"))


def _library() -> list[Path]:
    return sorted(UTILS.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str | None = None) -> set[str]:
    """Every utils or grader module that ``path`` imports, at the top or inside a function;
    ``package`` is the one its relative imports start from (by default, the one it is in)."""
    if package is None:
        package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] not in PACKAGES:
                continue
            # `from . import x` and `from .pkg import mod` may name modules, not attributes.
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else module)
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _level(name: str) -> int | None:
    if name == "grader" or name.startswith("grader."):
        return 5  # the grader: may use anything, and nothing of the library may use it
    if name == "utils.checks" or name.startswith("utils.checks."):
        return 4  # the checkers: may use the library, and no other module of it uses them
    return LEVELS.get(name)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_are_small(path):
    lines = len(path.read_text().splitlines())
    limit = CHECKER_LINES if path.parent in (UTILS / "checks", GRADER) else MODULE_LINES
    assert lines <= limit, f"{path.relative_to(ROOT)} has {lines} lines (at most {limit}): split it"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_classes_are_small(path):
    tree = ast.parse(path.read_text(), str(path))
    long = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - start + 1 > CLASS_LINES:
                long.append(f"{node.name} ({node.end_lineno - start + 1} lines)")
    assert not long, f"{path.relative_to(ROOT)}: classes over {CLASS_LINES} lines: {long}"


def test_every_library_module_has_a_level():
    missing = [_name(p) for p in _modules() if _level(_name(p)) is None]
    assert not missing, f"add these modules to LEVELS (and to CONTRIBUTING.md): {missing}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_only(path):
    """The library never imports the checkers or the grader, the checkers never import the
    grader, pieces know no stacks, stacks know no models."""
    name = _name(path)
    mine = _level(name)
    if mine is None:
        pytest.skip("reported by test_every_library_module_has_a_level")
    wrong = []
    for other in sorted(_imports(path)):
        theirs = _level(other)
        if theirs is not None and theirs > mine:
            wrong.append(f"{other} ({LEVEL_NAMES[theirs]})")
    assert not wrong, f"{name} ({LEVEL_NAMES[mine]}) imports from a level above it: {wrong}"


def test_the_import_reader_sees_lazy_and_relative_imports(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("from .masks import causal_mask\n\n\ndef f():\n"
                    "    from .checks import core\n    import utils.models\n")
    found = _imports(fake, package="utils")
    assert found == {"utils.masks", "utils.checks.core", "utils.models"}, found
    assert max(_level(m) for m in found) == 4


def _grader_imports(path: Path, package: str | None = None) -> list[str]:
    return sorted(m for m in _imports(path, package) if m == "grader" or m.startswith("grader."))


@pytest.mark.parametrize("path", _library(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_the_grader(path):
    """Nothing under utils/ (the checkers included) imports the grader, at the top or in a
    function: a reader who opens the library finds the book's code, not the sandbox."""
    found = _grader_imports(path)
    assert not found, f"{path.relative_to(ROOT)} imports the grader: {found}"


def test_the_grader_is_its_own_package():
    """grader/ is a package beside utils/, installed with it, and utils/checks holds none of
    its machinery."""
    assert (GRADER / "__init__.py").is_file()
    for name in ("sandbox", "child", "zygote", "kernel", "landlock", "seccomp", "protocol"):
        assert (GRADER / f"{name}.py").is_file(), name
        assert not (UTILS / "checks" / f"{name}.py").exists(), name
    assert 'packages = ["utils", "grader"]' in (ROOT / "pyproject.toml").read_text()


def test_the_boundary_test_sees_an_import_of_the_grader(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("import grader.sandbox\n\n\ndef f():\n    from grader import kernel\n"
                    "    from utils.checks import core\n")
    assert _grader_imports(fake, package="utils") == ["grader.kernel", "grader.sandbox"]
    relative = tmp_path / "relative.py"
    relative.write_text("from . import protocol\nfrom .kernel import landlock\n")
    found = _imports(relative, package="grader")
    assert found == {"grader.protocol", "grader.kernel"}, found
    assert min(_level(m) for m in found) == 5


def test_a_notebook_check_loads_nothing_of_the_grader():
    """What a notebook runs, ``from utils.checks import check_...`` and the check itself, loads
    no module of the grader (run in a fresh interpreter)."""
    code = (
        "import sys, torch\n"
        "from utils import checks\n"
        "from utils.attention import scaled_dot_product_attention\n"
        "for name in checks.__all__:\n"
        "    getattr(checks, name)\n"
        "checks.check_scaled_dot_product_attention(scaled_dot_product_attention, verbose=False)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'grader')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "", f"a notebook's check loaded the grader: {run.stdout}"
