"""Tests of utils.devices: picking a device, moving batches, and the batch makers' ``device=``.

The machine that runs the tests may have no GPU, so a real move is shown on the ``meta`` device
(tensors with a shape and no data): a tensor that did not move would still say ``cpu``.
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

import utils
from utils._validation import InputTypeError
from utils.data import LMBatch, MLMBatch, Seq2SeqBatch, pad_sequences
from utils.devices import available_devices, device, resolve_device, to_device
from utils.tasks import MissingDigitTask, ReversalTask, SortingTask

META = torch.device("meta")


def _devices(batch) -> dict[str, torch.device]:
    """The device of every tensor field of a batch dataclass."""
    return {k: v.device for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}


def _where_gpus_are_missing():
    if torch.cuda.is_available() or available_devices() != ["cpu"]:
        pytest.skip("this machine has a GPU: the test is about one without")


# ----- device() ------------------------------------------------------------------------------


def test_device_picks_the_cpu_here_and_says_so(capsys):
    _where_gpus_are_missing()
    assert utils.device is device  # exported from the package, as seed_everything is
    picked = device()
    out = capsys.readouterr().out
    assert picked == torch.device("cpu"), f"picked {picked} on a machine without a GPU"
    assert out == "device: cpu (no CUDA or MPS device found)\n", f"printed {out!r}"
    assert device(verbose=False) == torch.device("cpu")
    assert capsys.readouterr().out == "", "verbose=False must print nothing"
    assert device("cpu") == device(torch.device("cpu"), verbose=False) == torch.device("cpu")
    assert "as asked" in capsys.readouterr().out


@pytest.mark.parametrize(
    "prefer, error, phrase",
    [
        ("cuda", ValueError, "there is no cuda here; available here: cpu"),
        ("cuda:3", ValueError, "there is no cuda:3 here"),
        ("mps", ValueError, "there is no mps here"),
        ("gpu", ValueError, "'gpu' is not a device name; available here: cpu"),
        ("", ValueError, "not a device name"),
        (
            0,
            InputTypeError,
            "prefer must be a str such as 'cuda' or 'cpu', or a torch.device, "
            "got int; available here: cpu",
        ),
        (torch.zeros(1), InputTypeError, "got a torch.float32 tensor"),
    ],
)
def test_device_refuses_what_is_not_here_and_names_what_is(prefer, error, phrase, capsys):
    _where_gpus_are_missing()
    with pytest.raises(error) as caught:
        device(prefer)
    assert phrase in str(caught.value), f"the message was: {caught.value}"
    assert capsys.readouterr().out == "", "nothing is printed before an error"


def test_device_refuses_a_verbose_that_is_not_a_bool():
    with pytest.raises(InputTypeError, match="verbose must be True or False"):
        device(verbose=1)


def test_resolve_device_gives_indices_and_accepts_meta():
    assert resolve_device("meta") == META
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert available_devices()[-1] == "cpu"


# ----- to_device and batch.to ----------------------------------------------------------------


def _batches():
    pairs = [([3, 4, 5], [5, 4, 3]), ([6, 7], [7, 6])]
    ids = torch.tensor([[3, 4], [5, 6]])
    return [
        Seq2SeqBatch.from_pairs(pairs),
        LMBatch(ids, ids.clone(), ids > 0),
        MLMBatch(ids, ids.clone(), ids > 0),
    ]


@pytest.mark.parametrize("batch", _batches(), ids=lambda b: type(b).__name__)
def test_batch_to_moves_every_tensor_into_a_new_batch(batch):
    moved = batch.to("meta")
    assert type(moved) is type(batch)
    assert moved is not batch
    assert set(_devices(moved).values()) == {META}, f"not moved: {_devices(moved)}"
    assert set(_devices(batch).values()) == {torch.device("cpu")}, "the original must stay"
    for name, t in vars(moved).items():
        assert t.shape == getattr(batch, name).shape and t.dtype == getattr(batch, name).dtype
    back = batch.to(torch.device("cpu"))
    for name, t in vars(back).items():
        assert torch.equal(t, getattr(batch, name)), name


def test_batch_to_keeps_fields_that_are_not_tensors():
    ids = torch.tensor([[3, 4]])
    batch = LMBatch(ids, [[4, 5]], None)  # a list of ids and None: kept as they are
    moved = batch.to("meta")
    assert moved.inputs.device == META and moved.targets == [[4, 5]] and moved.mask is None


def test_batch_to_refuses_what_is_not_a_device():
    batch = _batches()[1]
    with pytest.raises(ValueError, match="not a device name"):
        batch.to("gpu")
    with pytest.raises(InputTypeError, match="device must be a str"):
        batch.to(3)


def test_to_device_moves_nested_containers_and_keeps_their_types():
    Pair = namedtuple("Pair", "x y")
    t = torch.ones(2)
    obj = {"a": (t, [t, 7, "word"]), "b": Pair(t, None), "c": _batches()[0], "d": OrderedDict(e=t)}
    moved = to_device(obj, "meta")
    assert moved["a"][0].device == META and moved["a"][1][0].device == META
    assert isinstance(moved["a"], tuple) and isinstance(moved["a"][1], list)
    assert moved["a"][1][1:] == [7, "word"]
    assert type(moved["b"]) is Pair and moved["b"].x.device == META and moved["b"].y is None
    assert set(_devices(moved["c"]).values()) == {META}
    assert type(moved["d"]) is OrderedDict and moved["d"]["e"].device == META
    assert obj["a"][0].device == torch.device("cpu"), "the original must not change"
    same = to_device(t, "cpu")
    assert same is t, "a tensor already there is returned, not copied (as Tensor.to does)"


# ----- the batch makers' device= -------------------------------------------------------------

TASKS = [ReversalTask(3, 6), SortingTask(2, 5), MissingDigitTask(4, 6)]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: type(t).__name__)
def test_batches_and_collate_put_the_batch_on_the_device(task):
    stream = task.batches(4, seed=0, pad_to=8, device="meta")
    moved = next(stream)
    plain = next(task.batches(4, seed=0, pad_to=8))
    assert set(_devices(moved).values()) == {META}, f"not moved: {_devices(moved)}"
    assert set(_devices(plain).values()) == {torch.device("cpu")}, "default must be the CPU"
    for name, t in vars(moved).items():
        assert t.shape == getattr(plain, name).shape, name
    on_cpu = next(task.batches(4, seed=0, pad_to=8, device="cpu"))
    for name, t in vars(on_cpu).items():  # the same draws wherever the batch goes
        assert torch.equal(t, getattr(plain, name)), name
    examples = task.sample(3, seed=1)
    assert set(_devices(task.collate(examples, device="meta")).values()) == {META}


@pytest.mark.parametrize("task", TASKS, ids=lambda t: type(t).__name__)
def test_batch_makers_check_the_device_when_called(task):
    _where_gpus_are_missing()
    with pytest.raises(ValueError, match="there is no cuda here"):
        task.batches(4, seed=0, device="cuda")  # not at the first draw: now
    with pytest.raises(ValueError, match="not a device name"):
        task.collate(task.sample(2, seed=0), device="gpu")


def test_pad_sequences_and_from_pairs_take_a_device():
    tokens, mask = pad_sequences([[3, 4], [5]], device="meta")
    assert tokens.device == mask.device == META
    tokens, mask = pad_sequences([[3, 4], [5]])
    assert tokens.device == mask.device == torch.device("cpu")
    batch = Seq2SeqBatch.from_pairs([([3], [3])], device="meta")
    assert set(_devices(batch).values()) == {META}
    with pytest.raises(InputTypeError, match="device must be a str"):
        pad_sequences([[3]], device=0)
