"""Frames between the grader and a sandboxed child: small JSON headers and raw tensor bytes.

A frame is a 4-byte big-endian length and that many bytes: a 4-byte length of a JSON header,
the header, then the raw bytes of the tensors the header lists. In the header, a tensor stands
as ``{"$t": INDEX}``, and ``"tensors"`` lists ``[dtype, shape, nbytes]`` for each, in the order
their bytes follow. Nothing is ever unpickled: the grader parses JSON of bounded size and depth,
and rebuilds each tensor from its bytes with `torch.frombuffer`, after checking its dtype, its
shape and its size. `decode` raises `ProtocolError` for anything else; the grader's schemas
(in `grader.messages`) then check every field of every message it accepts.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any

import torch

MAX_FRAME = 64 * 2**20  # no honest result comes near this
MAX_HEADER = 256 * 2**10
# The grader's own frames, read by the child: the start message carries every code cell of the
# notebook (up to 20 MiB of it, which JSON's escapes can make six times larger), so the bounds
# above, meant for what a child sends, do not apply to it; this one only catches a corrupt length.
MAX_TRUSTED_FRAME = 2**30
MAX_DEPTH = 12
MAX_TENSORS = 256
MAX_ELEMENTS = 4_000_000  # per tensor
_LEN = struct.Struct(">I")

DTYPES: dict[str, torch.dtype] = {
    str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                        torch.complex64, torch.complex128, torch.uint8, torch.int8, torch.int16,
                        torch.int32, torch.int64, torch.bool)
}


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed frame."""


def _flatten(value: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ProtocolError("a message nested too deeply")
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$t": len(tensors) - 1}
    if isinstance(value, dict):
        return {str(k): _flatten(v, tensors, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, tensors, depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ProtocolError(f"a {type(value).__name__} cannot be sent")


def encode(message: dict[str, Any]) -> bytes:
    """One frame holding ``message``: plain JSON values and tensors, nested."""
    tensors: list[torch.Tensor] = []
    body = _flatten(message, tensors)
    blobs, meta = [], []
    for t in tensors:
        t = t.detach().cpu().contiguous()
        if t.layout != torch.strided or str(t.dtype) not in DTYPES or t.is_quantized:
            raise ProtocolError(f"a tensor of dtype {t.dtype} and layout {t.layout}")
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        meta.append([str(t.dtype), list(t.shape), len(data)])
        blobs.append(data)
    header = json.dumps({"body": body, "tensors": meta}, allow_nan=True).encode()
    payload = _LEN.pack(len(header)) + header + b"".join(blobs)
    return _LEN.pack(len(payload)) + payload


def write_frame(fd: int, message: dict[str, Any]) -> None:
    """Write one frame to the file descriptor ``fd``."""
    data = memoryview(encode(message))
    while data:
        n = os.write(fd, data)
        data = data[n:]


def json_depth(data: bytes) -> int:
    """The nesting depth of the JSON text ``data`` (brackets inside strings do not count)."""
    depth = best = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > best:
                best = depth
                if best > MAX_DEPTH:
                    return best
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return best


def _rebuild(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$t"}:
            index = value["$t"]
            if not isinstance(index, int) or isinstance(index, bool) or not \
                    0 <= index < len(tensors):
                raise ProtocolError("a reference to no tensor")
            return tensors[index]
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild(v, tensors) for v in value]
    return value


def decode(payload: bytes, max_header: int = MAX_HEADER) -> dict[str, Any]:
    """The message of a frame's payload; raises `ProtocolError` on anything unexpected.

    ``max_header`` bounds the JSON header: `MAX_HEADER` for what a child sends, more only for
    the grader's own frames (`read_trusted`)."""
    if len(payload) < _LEN.size:
        raise ProtocolError("a frame shorter than its header")
    (hlen,) = _LEN.unpack_from(payload)
    if hlen > max_header or _LEN.size + hlen > len(payload):
        raise ProtocolError("a header larger than allowed or than its frame")
    raw = payload[_LEN.size: _LEN.size + hlen]
    if json_depth(raw) > MAX_DEPTH:
        raise ProtocolError("a message nested too deeply")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise ProtocolError("a header that is not JSON") from None
    if not isinstance(header, dict) or set(header) != {"body", "tensors"}:
        raise ProtocolError("a header without a body and a tensor list")
    meta, body = header["tensors"], header["body"]
    if not isinstance(meta, list) or len(meta) > MAX_TENSORS or not isinstance(body, dict):
        raise ProtocolError("a malformed header")
    offset = _LEN.size + hlen
    tensors = []
    for entry in meta:
        if not (isinstance(entry, list) and len(entry) == 3 and entry[0] in DTYPES
                and isinstance(entry[1], list) and len(entry[1]) <= 8
                and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_ELEMENTS
                        for s in entry[1])
                and isinstance(entry[2], int) and not isinstance(entry[2], bool)):
            raise ProtocolError("a malformed tensor entry")
        dtype = DTYPES[entry[0]]
        numel = 1
        for s in entry[1]:
            numel *= s
        if numel > MAX_ELEMENTS:
            raise ProtocolError("a tensor larger than allowed")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if entry[2] != nbytes or offset + nbytes > len(payload):
            raise ProtocolError("a tensor whose size does not match its bytes")
        data = bytearray(payload[offset: offset + nbytes])
        offset += nbytes
        if not nbytes:
            flat = torch.empty(0, dtype=dtype)
        elif dtype == torch.bool:  # any byte but 0 is True: never a bool tensor holding a 2
            flat = torch.frombuffer(data, dtype=torch.uint8) != 0
        else:
            flat = torch.frombuffer(data, dtype=dtype)
        tensors.append(flat.reshape(entry[1]))
    if offset != len(payload):
        raise ProtocolError("bytes left over after the last tensor")
    message = _rebuild(body, tensors)
    if not isinstance(message.get("op"), str):
        raise ProtocolError("a frame without an op")
    return message


class Reader:
    """Reads frames from a file descriptor, with a deadline per read."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()

    def _fill(self, n: int, deadline: float) -> None:
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, min(max(65536, n - len(self.buf)), 2**22))
            if not chunk:
                raise EOFError
            self.buf += chunk

    def read(self, deadline: float) -> dict[str, Any]:
        """The next message; TimeoutError past ``deadline``, EOFError when the other side is
        gone, `ProtocolError` for a malformed frame."""
        self._fill(_LEN.size, deadline)
        (length,) = _LEN.unpack_from(self.buf)
        if length > MAX_FRAME:
            raise ProtocolError("a frame larger than any result")
        self._fill(_LEN.size + length, deadline)
        payload = bytes(self.buf[_LEN.size: _LEN.size + length])
        del self.buf[: _LEN.size + length]
        return decode(payload)


def read_exact(fd: int, n: int) -> bytes:
    """Exactly ``n`` bytes from ``fd`` (blocking); EOFError if it closes first."""
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def read_trusted(fd: int) -> dict[str, Any]:
    """A frame from the grader, read by the child (blocking): held to `MAX_TRUSTED_FRAME`, not
    to the bounds on what a child sends (the start message holds the notebook's whole code)."""
    (length,) = _LEN.unpack(read_exact(fd, _LEN.size))
    if length > MAX_TRUSTED_FRAME:
        raise ProtocolError("a frame larger than allowed")
    return decode(read_exact(fd, length), max_header=MAX_TRUSTED_FRAME)
