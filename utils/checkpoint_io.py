"""Reading a Hugging Face checkpoint into a model built on the meta device (`utils.pretrained`).

A checkpoint is a directory holding ``config.json`` and ``model.safetensors``, or, for a large
model, shards (``model-00001-of-00004.safetensors``, ...) and an index,
``model.safetensors.index.json``, that says which shard holds each tensor. The loaders of
`utils.pretrained` never build a model on the CPU in float32 to copy it afterwards: they build
its skeleton on PyTorch's ``meta`` device (shapes and dtypes, no memory, no random
initialization), check every stored key and shape against it from the file's header alone, then
give each parameter a new tensor made directly on the device and in the dtype asked, filled from
the stored tensor, which is read from the file only then, one tensor at a time. On ``meta``
itself no tensor data is read at all.

Pieces:

* `StoredTensors`: the file's tensors by name, their shapes read from the header, each tensor
  read only when asked (`StoredTensors.get`), or given as an empty meta tensor;
* `Slots`: for every stored key the shape the model expects and a writer that assigns the
  model's parameter(s) from the stored tensor (`param_writer`, `set_param`);
* `linear_slots`, `norm_slots`: the slots of an `nn.Linear` and of a norm;
* `fill`: checks keys and shapes, runs every writer, re-ties tied weights, computes the
  non-persistent buffers on the device (`materialize_buffers`) and proves nothing is left on
  ``meta``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ._validation import shape_str

__all__ = [
    "read_checkpoint",
    "StoredTensors",
    "Slots",
    "set_param",
    "param_writer",
    "rows_first",
    "linear_slots",
    "norm_slots",
    "check_keys",
    "fill",
    "materialize_buffers",
]

# A sharded checkpoint's index: {"weight_map": {key: shard file name}}, beside the shards.
INDEX = "model.safetensors.index.json"

# For each stored key: its expected shape, and a writer ``write(stored, device, dtype)`` that
# assigns the model's parameter(s) from the stored tensor.
Slots = dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor, torch.device, torch.dtype], None]]]


def _paths(directory: str | Path) -> tuple[Path, Path | None]:
    """config.json of ``directory`` and its weights: model.safetensors, or None when the folder
    holds a sharded checkpoint's index (model.safetensors.index.json) instead; each checked to
    exist."""
    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    if weights_path.is_file():
        return config_path, weights_path
    if (directory / INDEX).is_file():
        return config_path, None
    raise FileNotFoundError(f"no model.safetensors (nor {INDEX}) in {directory}")


def _shards(directory: Path) -> dict[str, str]:
    """{key: shard file name} from a sharded checkpoint's index, checked: a dict of strings,
    each shard a plain file name in ``directory`` that exists."""
    index_path = directory / INDEX
    with open(index_path, encoding="utf-8") as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{index_path} is not valid JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{index_path} has no 'weight_map' of key -> shard file names")
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise ValueError(f"{index_path} names a shard outside its folder: {shard!r}")
        if not (directory / shard).is_file():
            keys = sorted(k for k, v in weight_map.items() if v == shard)
            raise FileNotFoundError(
                f"shard {shard} named in {index_path} is missing (it holds {len(keys)} "
                f"tensor(s), e.g. {keys[:3]})"
            )
    return weight_map


def _config(config_path: Path) -> dict:
    with open(config_path, encoding="utf-8") as f:
        return json.load(f)


def read_checkpoint(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of a Hugging Face directory: config.json and model.safetensors
    (or the shards its model.safetensors.index.json names), every tensor read into CPU memory
    at once (the loaders read them one by one instead, with `StoredTensors`).

    Raises:
        FileNotFoundError: if the directory, config.json, the weights or a shard is missing.
        ValueError: for an index that is not one, or a shard whose keys differ from the index's.
    """
    with StoredTensors(directory) as stored:
        return stored.config, {key: stored.get(key) for key in stored.shapes}


class StoredTensors:
    """The tensors of a checkpoint, by name, read lazily; a context manager.

    The tensors are those of one model.safetensors, or of every shard a sharded checkpoint's
    index (model.safetensors.index.json) names: each key read from the shard the index gives
    for it. A shard the index names must exist and hold exactly the keys the index gives it (an
    error names the shard and the key otherwise), so that a checkpoint is never read in part.

    Args:
        directory: the checkpoint's folder (config.json, and model.safetensors or the index
            and its shards).
        meta: True when the model goes to the ``meta`` device: then `get` reads nothing and
            returns empty meta tensors of the stored shapes (settable after opening).

    Attributes:
        config: config.json, as a dict.
        shapes: {key: shape} of every stored tensor, from the files' headers (no data read).
        source: {key: key in the file}; the loaders rename keys here (`rename`), and drop the
            ones the model has no place for on purpose (`drop`).
        files: the weight files read, in order (one, or the shards).
    """

    def __init__(self, directory: str | Path, meta: bool = False):
        config_path, weights_path = _paths(directory)
        self.config = _config(config_path)
        self.meta = meta
        self._handles: dict[str, object] = {}  # file name -> open safe_open
        self._where: dict[str, str] = {}  # key in the file -> file name
        try:
            if weights_path is not None:
                self._open(weights_path, None)
            else:
                weight_map = _shards(config_path.parent)
                for shard in sorted(set(weight_map.values())):
                    expected = {k for k, v in weight_map.items() if v == shard}
                    self._open(config_path.parent / shard, expected)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.files = list(self._handles)
        self.shapes = {
            k: tuple(self._handles[f].get_slice(k).get_shape()) for k, f in self._where.items()
        }
        self.source = {k: k for k in self.shapes}

    def _open(self, path: Path, expected: set[str] | None) -> None:
        """Open one weight file; with ``expected`` (a shard), check it holds exactly those keys."""
        handle = safe_open(str(path), framework="pt", device="cpu")
        self._handles[path.name] = handle
        keys = list(handle.keys())  # in the file's order: the order the tensors are listed in
        if expected is not None and set(keys) != expected:
            lacks, extra = sorted(expected - set(keys)), sorted(set(keys) - expected)
            raise ValueError(
                f"shard {path}: "
                + (
                    f"lacks {len(lacks)} key(s) the index places in it: {lacks[:3]}"
                    if lacks
                    else f"holds {len(extra)} key(s) the index does not place in it: {extra[:3]}"
                )
            )
        self._where |= dict.fromkeys(keys, path.name)  # the index places each key once

    def __enter__(self) -> StoredTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles.values():
            handle.__exit__(*exc)
        self._handles = {}

    def rename(self, names: dict[str, str]) -> None:
        """Address the stored tensor ``old`` as ``new`` from now on, for each ``old: new``."""
        self.shapes = {names.get(k, k): s for k, s in self.shapes.items()}
        self.source = {names.get(k, k): v for k, v in self.source.items()}

    def drop(self, key: str) -> None:
        """Forget ``key``: it is not loaded (and no longer counts as an unknown key)."""
        del self.shapes[key], self.source[key]

    def get(self, key: str) -> torch.Tensor:
        """The stored tensor ``key`` (CPU, as stored), or an empty float32 meta tensor of its
        shape when the model goes to ``meta``."""
        if self.meta:
            return torch.empty(self.shapes[key], device="meta")
        source = self.source[key]
        return self._handles[self._where[source]].get_tensor(source)

    def tied_head(self, key: str, table: str, where: str) -> None:
        """A tied model takes a stored output weight ``key`` only if it equals the token
        ``table``; then it is dropped. On ``meta`` only the shapes can be compared."""
        if key not in self.shapes or table not in self.shapes:
            return
        same = self.shapes[key] == self.shapes[table]
        if same and not self.meta:
            same = torch.equal(self.get(key), self.get(table))
        if not same:
            raise ValueError(
                f"{where}: {key} differs from {table}, but the config ties the "
                "output projection to the token embeddings (tie_word_embeddings)"
            )
        self.drop(key)


def set_param(
    module: nn.Module, name: str, value: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> None:
    """Replace ``module.<name>`` by a new parameter made on ``device`` in ``dtype``, holding
    ``value`` (converted as ``Tensor.copy_`` converts: the same numbers as copying into a model
    of that dtype). The new tensor is contiguous whatever ``value``'s strides (a transpose)."""
    old = module._parameters[name]
    new = torch.empty(value.shape, dtype=dtype, device=device)
    with torch.no_grad():
        new.copy_(value)
    setattr(module, name, nn.Parameter(new, requires_grad=old.requires_grad))


def set_param_transposed(
    module: nn.Module, name: str, stored: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Replace ``module.<name>`` by a parameter equal to ``stored.T`` whose numbers keep
    ``stored``'s layout: a contiguous copy of ``stored`` (d_in, d_out) made on ``device`` in
    ``dtype``, the parameter its transposed view (d_out, d_in). ``x @ W.T`` then reads the
    weight row by row, the faster way for one token (`utils.pretrained`'s GPT-2 layout). Returns
    the contiguous copy."""
    old = module._parameters[name]
    new = torch.empty(stored.shape, dtype=dtype, device=device)
    with torch.no_grad():
        new.copy_(stored)
    setattr(module, name, nn.Parameter(new.T, requires_grad=old.requires_grad))
    return new


def param_writer(
    module: nn.Module, name: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Callable[[torch.Tensor, torch.device, torch.dtype], None]:
    """A writer that sets ``module.<name>`` to ``transform(stored)`` (the stored tensor itself
    by default)."""

    def write(stored: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        set_param(module, name, stored if transform is None else transform(stored), device, dtype)

    return write


def rows_first(module: nn.Module, name: str, transposed: bool) -> Callable:
    """A writer of ``module.<name>`` (d_out, d_in) whose numbers lie as (d_in, d_out) rows
    (`set_param_transposed`, as `utils.pretrained` loads GPT-2); ``transposed``: the stored
    tensor is (d_in, d_out) already, else it is (d_out, d_in) and is laid out anew once."""

    def write(stored: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        set_param_transposed(module, name, stored if transposed else stored.T, device, dtype)

    return write


def linear_slots(prefix: str, linear: nn.Linear, conv1d: bool = False) -> Slots:
    """The weight (and bias) of ``linear``; ``conv1d``: stored transposed, (d_in, d_out), and
    kept so (`set_param_transposed`: the weight is a (d_out, d_in) view of those numbers)."""
    out_f, in_f = linear.weight.shape
    slots: Slots = {}
    if conv1d:
        slots[f"{prefix}.weight"] = ((in_f, out_f), rows_first(linear, "weight", True))
    else:
        slots[f"{prefix}.weight"] = ((out_f, in_f), param_writer(linear, "weight"))
    if linear.bias is not None:
        slots[f"{prefix}.bias"] = ((out_f,), param_writer(linear, "bias"))
    return slots


def norm_slots(prefix: str, norm: nn.Module) -> Slots:
    """The gain (and bias, if any) of a `LayerNorm` or `RMSNorm` (``norm.d_model`` wide)."""
    slots: Slots = {f"{prefix}.weight": ((norm.d_model,), param_writer(norm, "weight"))}
    if getattr(norm, "bias", None) is not None:
        slots[f"{prefix}.bias"] = ((norm.d_model,), param_writer(norm, "bias"))
    return slots


def check_keys(shapes: dict[str, tuple[int, ...]], slots: Slots, where: str) -> None:
    """Every stored key must have a slot, every slot a key, every shape must match. Unknown and
    missing keys are named in one message: a renamed key is both, and each half explains the
    other."""
    unknown = sorted(set(shapes) - set(slots))
    missing = sorted(set(slots) - set(shapes))
    problems = []
    if unknown:
        problems.append(
            f"holds {len(unknown)} unknown key(s) the model has no place for: {unknown[:5]}"
        )
    if missing:
        problems.append(f"lacks {len(missing)} key(s) the model needs: {missing[:5]}")
    if problems:
        raise ValueError(f"{where} " + "; and ".join(problems))
    for key, (shape, _) in slots.items():
        if shapes[key] != shape:
            raise ValueError(
                f"{where}: {key} has shape {shape_str(shapes[key])}, expected {shape_str(shape)}"
            )


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Compute on ``device`` every buffer that building on ``meta`` left without values.

    A module whose buffers are computed, not stored (rotary tables, causal masks), recomputes
    them in a method ``init_buffers()``, which is called here under ``torch.device(device)``;
    a buffer left on ``meta`` by a module without one is an error naming it.
    """
    if device.type == "meta":
        return
    for name, module in model.named_modules():
        if not any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            continue
        init = getattr(module, "init_buffers", None)
        if not callable(init):
            raise RuntimeError(
                f"{name or type(module).__name__} has a buffer on the meta device and no "
                "init_buffers() to compute it on the device asked"
            )
        with torch.device(device):
            init()


def fill(
    model: nn.Module,
    stored: StoredTensors,
    slots: Slots,
    where: str,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """Check every key and shape, then give every parameter its stored tensor on ``device`` in
    ``dtype``, one stored tensor at a time; returns the model in eval mode.

    ``model`` was built on ``meta``; ties between modules (``model.tie_weights()``, if it has
    one) are made again after the parameters are replaced, and nothing may be left on ``meta``
    unless ``device`` is ``meta``.
    """
    check_keys(stored.shapes, slots, where)
    for key, (_, write) in slots.items():
        write(stored.get(key), device, dtype)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    materialize_buffers(model, device)
    if device.type != "meta":
        left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"{where}: no value was loaded for {left[:5]}")
    return model.eval()
