"""The reads a decoding loop makes from the device, grouped (`utils.decoding`).

A decoding step needs two answers from the device: were the logits sound (no NaN, no +inf, a
finite score in every row), and is every row finished? Reading either on the host waits for
the device to finish all the work queued so far; on a GPU that idles it while the host prepares
the next step. `Watch` reads them every step (``every=1``, the plain loop) or once every k
steps, in order, so that the loop ends, and errors are raised, as the plain loop would.

`checked_pick` is the plain loop's step: check the logits (one sum in the usual case), then
pick. `bad_logits_code` is the check left on the device, a code read later.

The checks the decoding functions make at their edge, before any step, are here too:
`check_sampling`, `check_model`, `check_room` and `prompt_batch`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ._validation import (
    InputTypeError,
    require_int,
    require_integer_ids,
    require_rank,
    require_real,
    type_name,
    values_trusted,
)
from .data import _as_ids, _is_sequence, pad_sequences

__all__ = ["CHECK_EVERY", "Watch", "check_every_for", "checked_pick", "bad_logits_code",
           "check_sampling", "check_model", "check_room", "prompt_batch"]


# What `bad_logits_code` finds, by code (0: nothing wrong), as `next_token` reports it.
_BAD_LOGITS = {
    1: "logits must not contain NaN or +inf",
    2: "every row of logits needs at least one finite score, got a row that is all -inf",
}


def bad_logits_code(logits: torch.Tensor) -> torch.Tensor:
    """A 0-dim int tensor on the logits' device, computed there without reading anything back:
    1 if (B, V) ``logits`` hold NaN or +inf, else 2 if a row has no finite score, else 0."""
    nan_or_inf = (torch.isnan(logits) | (logits == math.inf)).any()
    empty_row = ~torch.isfinite(logits).any(dim=-1).all()
    return torch.where(nan_or_inf, 1, torch.where(empty_row, 2, 0))


def _raise_bad_logits(code: torch.Tensor | int) -> None:
    message = _BAD_LOGITS.get(int(code))
    if message is not None:
        raise ValueError(message)


def checked_pick(logits: torch.Tensor, temperature: float,
                 generator: torch.Generator | None) -> torch.Tensor:
    """(B,) ids from (B, V) logits, checked first as `utils.decoding.next_token` documents: a
    ValueError for NaN or +inf, or a row with no finite score.

    Greedy picking checks only the B scores it picked: argmax picks a NaN wherever a row holds
    one, else a +inf wherever it holds one, and -inf only from a row of nothing else, so the
    picked scores are all finite exactly when the logits are sound (no pass over V scores).
    Sampling checks one sum, finite exactly when every score is (finite scores that overflow
    it go on to the full check, and pass)."""
    if temperature == 0:
        picked, tok = logits.max(dim=-1)  # the first maximal score of each row, as argmax
        if not math.isfinite(float(picked.sum())):  # finite scores that overflow: checked below
            _raise_bad_logits(bad_logits_code(logits))
        return tok
    if not bool(torch.isfinite(logits.sum())):
        _raise_bad_logits(bad_logits_code(logits))
    return _pick(logits, temperature, generator)


def _pick(logits: torch.Tensor, temperature: float,
          generator: torch.Generator | None) -> torch.Tensor:
    """(B,) ids from checked (B, V) logits: argmax at temperature 0, else a draw."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# Steps between two reads of the decoding state on a device other than the CPU (`Watch`).
CHECK_EVERY = 8


def check_every_for(value: object, device: torch.device) -> int:
    """``check_every``: a positive int, or None: 1 on the CPU (reading a CPU tensor waits for
    nothing, and a step run after every row is finished is wasted work), `CHECK_EVERY` on an
    accelerator (where each read waits for the device to finish all the work queued)."""
    if value is None:
        return 1 if device.type == "cpu" else CHECK_EVERY
    return require_int("check_every", value)


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator ``torch.multinomial`` draws from when given none, where it can be named."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None  # e.g. MPS: sampling without a generator of its own reads every step


def _vocab_fits(model: nn.Module, logits: torch.Tensor) -> bool:
    """Whether every id the logits can pick is one the model takes (its ``vocab_size``, or its
    target embedding's): then the loop's own tokens need no range check on the device."""
    limit = getattr(model, "vocab_size", getattr(getattr(model, "tgt_embed", None), "vocab_size",
                                                 None))
    return isinstance(limit, int) and logits.shape[-1] <= limit


class Watch:
    """What a decoding loop reads back from the device: whether each step's logits were sound
    and which rows are finished, once every ``every`` steps.

    ``every == 1`` is the plain loop: each step checks its logits as `next_token` does and reads
    how many rows are finished. With ``every = k > 1`` nothing is read inside a step: each step
    leaves on the device a code for its logits (`bad_logits_code`) and whether any and all rows
    are finished, and every k-th step (and the last) reads the k steps at once, in order: the
    first bad step raises `next_token`'s error, and the first step after which every row was
    finished ends the loop, the generator put back as it was after that step's draw. The tokens
    are those of ``every == 1``; up to k - 1 steps are computed past the end and discarded.
    The loop's own tokens and positions are fed without the models' range checks
    (`values_trusted`), which would read them back; prompts are checked as always.
    """

    def __init__(self, every: int, device: torch.device, temperature: float,
                 generator: torch.Generator | None):
        self.every, self.any_done, self.trusted = every, False, False
        self._window: list[torch.Tensor] = []
        self._states: list[torch.Tensor] = []  # the generator after each step's draw
        self._rng, self._code = None, None
        if every > 1 and temperature > 0:
            self._rng = generator if generator is not None else _default_generator(device)
            if self._rng is None:  # a draw could not be undone: read every step
                self.every = 1

    def trust(self, model: nn.Module, logits: torch.Tensor) -> None:
        """After the first step (prompts checked by the model): trust the loop's own tokens,
        which are ids the model takes when its vocabulary covers every score's position."""
        self.trusted = _vocab_fits(model, logits)

    def feeding(self) -> contextlib.AbstractContextManager:
        """The context of one model call: `values_trusted` once `trust` said so."""
        return values_trusted() if self.trusted else contextlib.nullcontext()

    def pick(self, logits: torch.Tensor, temperature: float,
             generator: torch.Generator | None) -> torch.Tensor:
        """The step's (B,) ids from its (B, V) logits."""
        if self.every == 1:
            return checked_pick(logits, temperature, generator)
        self._code = bad_logits_code(logits)
        if temperature > 0:  # a bad step raises at the read; its draw must not fail first
            logits = torch.where(self._code == 0, logits, torch.zeros_like(logits))
        tok = _pick(logits, temperature, generator)
        if self._rng is not None:
            self._states.append(self._rng.get_state())
        return tok

    def finished(self, done: torch.Tensor, last: bool) -> bool:
        """After a step updated ``done`` (B,) bool: whether the loop ends here (every row
        finished, as far as has been read); ``last``: the loop's last step, always read."""
        if self.every == 1:
            count = int(done.sum())
            self.any_done = count > 0
            return count == done.numel()
        self._window.append(torch.stack([self._code, done.any().long(), done.all().long()]))
        if not last and len(self._window) < self.every:
            return False
        steps = torch.stack(self._window).tolist()  # the one read of the window
        states, self._window, self._states = self._states, [], []
        for j, (code, any_done, all_done) in enumerate(steps):
            _raise_bad_logits(code)
            self.any_done = self.any_done or bool(any_done)
            if all_done:
                if states:
                    self._rng.set_state(states[j])
                return True
        return False


# ------------------------------------------------- the checks at the decoding functions' edge


def check_sampling(temperature: object, generator: object) -> float:
    """``temperature`` a finite number >= 0; ``generator`` None or a `torch.Generator`."""
    temperature = require_real("temperature", temperature, low=0.0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generator must be a torch.Generator or None, got "
                             f"{type_name(generator)}")
    return temperature


def check_model(model: object, calls: str) -> None:
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be an nn.Module with {calls}, got {type_name(model)}")


def check_room(model: nn.Module, needed: int, what: str) -> None:
    """Refuse, before any step, to feed ``model`` more positions than its ``max_len``."""
    limit = getattr(model, "max_len", None)
    if isinstance(limit, int) and needed > limit:
        raise ValueError(f"{what} needs {needed} positions but the model takes at most "
                         f"max_len={limit}")


def prompt_batch(prompts: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Check the prompts and pad them into one (B, L) batch and its mask (see `generate`);
    None when there are no prompts."""
    if isinstance(prompts, torch.Tensor):
        require_rank("prompts", prompts, "(B, L)", rank=2)
        require_integer_ids("prompts", prompts)
        prompts = list(prompts)
    elif not _is_sequence(prompts):
        raise InputTypeError(f"prompts must be a list of prompts, each a list of token ids, got "
                             f"{type_name(prompts)}")
    if len(prompts) == 0:
        return None
    for i, p in enumerate(prompts):
        if not _is_sequence(p):
            raise InputTypeError(f"prompts must be a list of prompts, each a list of token ids; "
                                 f"prompts[{i}] is {type_name(p)}")
    tokens, real = pad_sequences([_as_ids(f"prompts[{i}]", p) for i, p in enumerate(prompts)])
    if int(tokens.min()) < 0:
        raise ValueError(f"prompts must hold token ids >= 0, got {int(tokens.min())}")
    return tokens, real
