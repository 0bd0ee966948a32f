"""`load_gpt2` and `load_llama` with ``device=`` and ``dtype=``: built on meta, made where asked.

The checkpoints are those of tests/test_pretrained.py (written by `transformers` itself, random
weights, nothing downloaded). What is checked:

* ``device="meta"`` gives every parameter on meta, in the dtype asked, of the shapes a CPU load
  gives, and reads no tensor: no stored tensor is fetched from the file, and no operation
  makes a floating-point tensor anywhere but on meta (a recorder sees every operation; the
  controls show it seeing the CPU build of the old loaders and the reads of a CPU load);
* ``device="cpu"`` in float32 gives the stored numbers themselves, contiguous, and the logits of
  a model built on the CPU the old way and copied into (bit for bit); in bfloat16 and float16
  every parameter is in that dtype and is the float32 one rounded;
* nothing is left on meta after a real load (the control: a tie not remade is caught);
* a module whose buffers are computed gets them computed on the device.
"""

from __future__ import annotations

import pytest
import test_pretrained
import torch
from test_pretrained import VOCAB, _load
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from utils import checkpoint_io, pretrained
from utils._validation import InputTypeError
from utils.checkpoint_io import materialize_buffers, read_checkpoint
from utils.checkpoint_models import CheckpointLM

# The checkpoints of tests/test_pretrained.py, written once per module, and its one thread.
checkpoints = test_pretrained.checkpoints
one_thread = test_pretrained.one_thread

NAMES = ["gpt2/d32-h2-tied", "gpt2/d48-h4-untied", "llama/grouped-query", "llama/multi-head-tied"]


class _Recorder(TorchDispatchMode):
    """Records every operation that returns a floating-point tensor off the meta device."""

    def __init__(self):
        super().__init__()
        self.off_meta: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                self.off_meta.append(f"{func} -> {t.dtype} {tuple(t.shape)} on {t.device}")
        return out


class _CountingFile:
    """safe_open, counting the tensors read from the file."""

    reads = 0

    def __init__(self, *args, **kwargs):
        from safetensors import safe_open

        self._file = safe_open(*args, **kwargs)

    def get_tensor(self, name):
        _CountingFile.reads += 1
        return self._file.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self._file, name)


def _load_recorded(monkeypatch, name, directory, **kw):
    """(model, operations off meta, tensors read from the file) of one load."""
    _CountingFile.reads = 0
    monkeypatch.setattr(checkpoint_io, "safe_open", _CountingFile)
    with _Recorder() as recorder:
        model = _load(name, directory, **kw)
    return model, recorder.off_meta, _CountingFile.reads


def _tensors(model):
    return dict(model.named_parameters()) | dict(model.named_buffers())


@pytest.mark.parametrize("name", NAMES)
def test_meta_load_reads_no_tensor_and_has_every_shape(checkpoints, monkeypatch, name):
    directory, _ = checkpoints[name]
    model, off_meta, reads = _load_recorded(
        monkeypatch, name, directory, device="meta", dtype=torch.bfloat16
    )
    assert off_meta == [], f"operations made floating-point tensors off meta: {off_meta[:5]}"
    assert reads == 0, f"{reads} stored tensors were read for a meta load"
    on_cpu = _tensors(_load(name, directory))
    meta = _tensors(model)
    assert meta.keys() == on_cpu.keys()
    for key, t in meta.items():
        assert t.is_meta, f"{key} is on {t.device}"
        assert t.dtype == torch.bfloat16, f"{key} is {t.dtype}"
        assert t.shape == on_cpu[key].shape, f"{key}: {tuple(t.shape)}"
    assert (model.head.weight is model.embed.weight) == model.tie_output


def test_the_recorders_see_a_cpu_build_and_the_reads(checkpoints, monkeypatch):
    """Controls: what the meta test counts is there to count in a CPU load, and in the old
    loaders' way of building the model (on the CPU, in float32, randomly initialised)."""
    name = "gpt2/d32-h2-tied"
    directory, _ = checkpoints[name]
    _, off_meta, reads = _load_recorded(monkeypatch, name, directory, device="cpu")
    stored = read_checkpoint(directory)[1]
    assert reads == len(stored) and off_meta, (reads, len(stored))
    with _Recorder() as recorder:
        pretrained._gpt2_model(pretrained._gpt2_settings(read_checkpoint(directory)[0]))
    assert any("float32" in op and "cpu" in op for op in recorder.off_meta)


def test_a_cpu_load_builds_nothing_on_the_cpu(checkpoints, monkeypatch):
    """bfloat16 on the CPU: the only float32 tensors are the stored ones, read one at a time;
    no random initialization runs off meta (the old loaders initialised a float32 model)."""
    name = "llama/grouped-query"
    directory, _ = checkpoints[name]
    _, off_meta, _ = _load_recorded(monkeypatch, name, directory, dtype=torch.bfloat16)
    init = [op for op in off_meta if any(w in op for w in ("uniform", "normal", "kaiming"))]
    assert init == [], f"random initialization off meta: {init[:3]}"


@pytest.mark.parametrize("name", NAMES)
def test_float32_on_the_cpu_is_the_old_path(checkpoints, name):
    directory, _ = checkpoints[name]
    ours = _load(name, directory, device="cpu")
    config, stored = read_checkpoint(directory)
    if name.startswith("gpt2"):  # built on the CPU and copied into, as the loaders did
        old = pretrained._gpt2_model(pretrained._gpt2_settings(config))
        assert torch.equal(ours.embed.weight, stored["transformer.wte.weight"])
        d = ours.d_model
        c_attn = stored["transformer.h.1.attn.c_attn.weight"]
        assert torch.equal(ours.blocks[1].attn.w_k.weight, c_attn[:, d : 2 * d].T)
    else:
        old = pretrained._llama_model(pretrained._llama_settings(config), "half")
        k_proj = stored["model.layers.1.self_attn.k_proj.weight"]
        assert torch.equal(ours.blocks[1].attn.w_k.weight, k_proj)
    old.load_state_dict(ours.state_dict())
    for key, t in _tensors(ours).items():
        assert t.device.type == "cpu" and t.dtype == torch.float32, key
        if name.startswith("gpt2") and t.dim() == 2 and "positions" not in key:
            # GPT-2's matrices keep the checkpoint's (d_in, d_out) rows: (d_out, d_in) views
            # of them (Q, K and V each a third of one c_attn matrix)
            assert t.T.is_contiguous() or (t.stride(0) == 1 and "attn.w_" in key), (
                f"{key} has strides {t.stride()}")
        else:
            assert t.is_contiguous(), f"{key} has strides {t.stride()}"
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        new, before = ours(tokens), old.eval()(tokens)
    if name.startswith("gpt2"):  # the same numbers read in another order: rounding only
        torch.testing.assert_close(new, before, atol=1e-5, rtol=0)
    else:
        assert torch.equal(new, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", ["gpt2/d48-h4-untied", "llama/multi-head-tied"])
def test_other_dtypes_on_the_cpu_are_the_float32_weights_rounded(checkpoints, name, dtype):
    directory, _ = checkpoints[name]
    ours = _load(name, directory, dtype=dtype, device=torch.device("cpu"))
    full = _tensors(_load(name, directory))
    for key, t in _tensors(ours).items():
        assert t.dtype == dtype and t.device.type == "cpu", f"{key}: {t.dtype} on {t.device}"
        assert torch.equal(t, full[key].to(dtype)), key
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        got = ours(tokens)
        expected = _load(name, directory)(tokens)
    assert got.dtype == dtype
    scale = expected.abs().max()
    error = (got.double() - expected.double()).abs().max()
    assert error < 0.05 * scale, f"{dtype}: logits off by {error:.3g} (scale {scale:.3g})"


def test_nothing_is_left_on_meta_and_a_missing_tie_is_caught(checkpoints, monkeypatch):
    name = "gpt2/d32-h2-tied"
    directory, _ = checkpoints[name]
    model = _load(name, directory, device="cpu")
    left = [k for k, t in _tensors(model).items() if t.is_meta]
    assert left == [] and model.head.weight is model.embed.weight
    monkeypatch.setattr(CheckpointLM, "tie_weights", lambda self: None)  # the tie not remade
    with pytest.raises(RuntimeError, match=r"no value was loaded for \['head\.weight'\]"):
        _load(name, directory, device="cpu")
    assert _load(name, directory, device="meta").head.weight.is_meta  # meta: nothing to check


class _Rotary(nn.Module):
    """A module with a computed, non-persistent buffer, as rotary tables are."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(2, 2)
        self.init_buffers()

    def init_buffers(self) -> None:
        self.register_buffer("table", torch.arange(self.n).float().cos(), persistent=False)


def test_computed_buffers_are_computed_on_the_device():
    with torch.device("meta"):
        model = nn.Sequential(_Rotary())
    assert model[0].table.is_meta
    materialize_buffers(model, torch.device("cpu"))
    assert torch.equal(model[0].table, _Rotary().table)
    with torch.device("meta"):
        bare = nn.Module()
        bare.register_buffer("mask", torch.ones(3), persistent=False)
    with pytest.raises(RuntimeError, match="buffer on the meta device and no init_buffers"):
        materialize_buffers(bare, torch.device("cpu"))


def test_bad_devices_are_refused(checkpoints):
    directory = checkpoints["llama/multi-query"][0]
    with pytest.raises(InputTypeError, match="device must be a torch.device"):
        pretrained.load_llama(directory, device=3.5)
    with pytest.raises(ValueError, match="device must name a device"):
        pretrained.load_gpt2(checkpoints["gpt2/d32-h2-tied"][0], device="nowhere")
