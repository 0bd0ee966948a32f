"""Frames between the grader and a sandboxed child: JSON for control, ``torch.save`` for tensors.

A frame is one type byte (``J`` or ``T``), an 8-byte big-endian length and the payload. The
grader reads tensor frames with ``torch.load(..., weights_only=True)``, which builds tensors and
plain containers only: nothing the child sends can run code in the grader.
"""

from __future__ import annotations

import io
import json
import os
import select
import struct
import time
from typing import Any

import torch

MAX_FRAME = 64 * 2**20  # no honest result comes near this
_HEADER = struct.Struct(">cQ")


class ProtocolError(Exception):
    """The child sent something that is not a well-formed frame, or nothing in time."""


def encode(message: dict[str, Any], tensors: bool = False) -> bytes:
    """One frame holding ``message``."""
    if tensors:
        buf = io.BytesIO()
        torch.save(message, buf)
        payload, kind = buf.getvalue(), b"T"
    else:
        payload, kind = json.dumps(message).encode(), b"J"
    return _HEADER.pack(kind, len(payload)) + payload


def write_frame(fd: int, message: dict[str, Any], tensors: bool = False) -> None:
    """Write one frame to the file descriptor ``fd``."""
    data = memoryview(encode(message, tensors))
    while data:
        n = os.write(fd, data)
        data = data[n:]


def decode(kind: bytes, payload: bytes) -> dict[str, Any]:
    """The message of a frame; raises `ProtocolError` on anything unexpected."""
    try:
        if kind == b"J":
            msg = json.loads(payload.decode())
        elif kind == b"T":
            msg = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        else:
            raise ProtocolError(f"unknown frame type {kind!r}")
    except ProtocolError:
        raise
    except Exception as exc:  # a malformed payload
        raise ProtocolError(f"unreadable frame: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("a frame without an op")
    return msg


class Reader:
    """Reads frames from a file descriptor with a deadline."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""

    def _fill(self, n: int, deadline: float) -> None:
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, max(65536, n - len(self.buf)))
            if not chunk:
                raise EOFError
            self.buf += chunk

    def read(self, deadline: float) -> dict[str, Any]:
        """The next message; TimeoutError past ``deadline``, EOFError when the child is gone."""
        self._fill(_HEADER.size, deadline)
        kind, length = _HEADER.unpack(self.buf[: _HEADER.size])
        if length > MAX_FRAME:
            raise ProtocolError("a frame larger than any result")
        self._fill(_HEADER.size + length, deadline)
        payload = self.buf[_HEADER.size: _HEADER.size + length]
        self.buf = self.buf[_HEADER.size + length:]
        return decode(kind, payload)


def read_exact(fd: int, n: int) -> bytes:
    """Exactly ``n`` bytes from ``fd`` (blocking); EOFError if it closes first."""
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def read_trusted(fd: int) -> dict[str, Any]:
    """A frame from the grader, read by the child (which trusts it)."""
    kind, length = _HEADER.unpack(read_exact(fd, _HEADER.size))
    return decode(kind, read_exact(fd, length))
