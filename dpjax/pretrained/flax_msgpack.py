"""flax msgpack files, read lazily: the tree decoded, array bytes only located.

The format, as written by `flax.serialization.to_bytes` (flax's
`serialization.py`: `msgpack_serialize`, `_ndarray_to_bytes`,
`_chunk_array_leaves_in_place`): one msgpack document, the state dict of a
pytree (maps with string keys, lists, scalars, None). Arrays inside it are
msgpack ext values (code 1 `ndarray`, 3 numpy scalar) whose payload is itself
msgpack `(shape, dtype name, raw C-order bytes)`; code 2 is a complex number
`(real, imag)`. Arrays over 2**30 bytes are split into
`{'__msgpack_chunked_array__': True, 'shape': {...}, 'chunks': {...}}`, the
shape and the flat chunks as dicts keyed '0', '1', ...

What the reader guarantees: `MsgpackParser` decodes the structure (maps,
lists, strings, numbers) but only locates array payloads: a bin value is a
`Span` (offset, length) and an array an `InlineArray` (shape, dtype, span),
so parsing a memory-mapped file touches the structure and none of the array
bytes. `unchunk` turns chunked dicts into `ChunkedArray`s; `read_array`
copies one array out of the buffer, the only read of array bytes.

Costs and limits: parsing is pure Python and linear in the number of msgpack
values (not bytes), and the whole structure is decoded and kept at once:
fast for a params tree of thousands of leaves, slow for millions of small
values. Other ext codes (e.g. msgpack timestamps) come back undecoded as
`('msgpack-ext', code, Span)`. bfloat16 is ml_dtypes'. A malformed document
raises one of `PARSE_ERRORS`.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

CHUNKED = "__msgpack_chunked_array__"
# What `MsgpackParser.parse` raises on a malformed or truncated document.
PARSE_ERRORS = (ValueError, IndexError, struct.error, UnicodeDecodeError)


@dataclasses.dataclass(frozen=True)
class Span:
  """A msgpack bin value: `length` raw bytes at `offset` in the file."""
  offset: int
  length: int


@dataclasses.dataclass(frozen=True)
class InlineArray:
  """A flax-serialized ndarray stored in the msgpack file."""
  shape: tuple[int, ...]
  dtype: np.dtype
  span: Span


@dataclasses.dataclass(frozen=True)
class ChunkedArray:
  """flax's split form of an inline array over 2**30 bytes."""
  shape: tuple[int, ...]
  chunks: tuple[InlineArray, ...]

  @property
  def dtype(self) -> np.dtype:
    """The dtype of the chunks."""
    return self.chunks[0].dtype


def dtype_from_name(name: str) -> np.dtype:
  """The numpy dtype of a stored dtype name ('bfloat16' is ml_dtypes')."""
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


class MsgpackParser:
  """Decodes msgpack from a buffer; bin payloads become `Span`s."""

  _FIXED = {0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q",
            0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q",
            0xca: ">f", 0xcb: ">d"}

  def __init__(self, buf):
    self.buf = buf

  def _uint(self, pos: int, size: int) -> int:
    return int.from_bytes(self.buf[pos:pos + size], "big")

  def parse(self, pos: int) -> tuple[Any, int]:
    """(the value starting at `pos`, the position after it)."""
    b = self.buf[pos]
    pos += 1
    if b <= 0x7f:
      return b, pos
    if b >= 0xe0:
      return b - 0x100, pos
    if 0x80 <= b <= 0x8f:
      return self._map(pos, b & 0x0f)
    if 0x90 <= b <= 0x9f:
      return self._array(pos, b & 0x0f)
    if 0xa0 <= b <= 0xbf:
      return self._str(pos, b & 0x1f)
    if b == 0xc0:
      return None, pos
    if b in (0xc2, 0xc3):
      return b == 0xc3, pos
    if b in self._FIXED:
      fmt = self._FIXED[b]
      size = struct.calcsize(fmt)
      return struct.unpack(fmt, self.buf[pos:pos + size])[0], pos + size
    if b in (0xc4, 0xc5, 0xc6):  # bin 8/16/32
      size = 1 << (b - 0xc4)
      n = self._uint(pos, size)
      return Span(pos + size, n), pos + size + n
    if b in (0xc7, 0xc8, 0xc9):  # ext 8/16/32
      size = 1 << (b - 0xc7)
      n = self._uint(pos, size)
      return self._ext(pos + size, n)
    if 0xd4 <= b <= 0xd8:  # fixext 1/2/4/8/16
      return self._ext(pos, 1 << (b - 0xd4))
    if b in (0xd9, 0xda, 0xdb):  # str 8/16/32
      size = 1 << (b - 0xd9)
      return self._str(pos + size, self._uint(pos, size))
    if b in (0xdc, 0xdd):  # array 16/32
      size = 2 if b == 0xdc else 4
      return self._array(pos + size, self._uint(pos, size))
    if b in (0xde, 0xdf):  # map 16/32
      size = 2 if b == 0xde else 4
      return self._map(pos + size, self._uint(pos, size))
    raise ValueError(f"invalid msgpack byte 0x{b:02x} at offset {pos - 1}")

  def _str(self, pos, n):
    return bytes(self.buf[pos:pos + n]).decode("utf-8"), pos + n

  def _array(self, pos, n):
    out = []
    for _ in range(n):
      x, pos = self.parse(pos)
      out.append(x)
    return out, pos

  def _map(self, pos, n):
    out = {}
    for _ in range(n):
      k, pos = self.parse(pos)
      v, pos = self.parse(pos)
      out[k] = v
    return out, pos

  def _ext(self, pos, n):
    """`pos` points at the ext type byte, followed by `n` payload bytes."""
    code = struct.unpack(">b", self.buf[pos:pos + 1])[0]
    start, end = pos + 1, pos + 1 + n
    if code in (1, 3):  # flax ndarray / numpy scalar: (shape, dtype, bytes)
      (shape, dtype_name, span), stop = self.parse(start)
      if stop != end or not isinstance(span, Span):
        raise ValueError(f"malformed array at offset {start}")
      if isinstance(dtype_name, Span):  # written with raw (bin) strings
        dtype_name = bytes(self.buf[dtype_name.offset:dtype_name.offset
                                    + dtype_name.length]).decode()
      return InlineArray(tuple(int(d) for d in shape), dtype_from_name(dtype_name),
                         span), end
    if code == 2:  # native complex (real, imag)
      (re_, im), _ = self.parse(start)
      return complex(re_, im), end
    return ("msgpack-ext", code, Span(start, n)), end


def unchunk(tree):
  """Replaces flax's chunked-array dicts by `ChunkedArray`s."""
  if not isinstance(tree, dict):
    return tree
  if tree.get(CHUNKED) is True:
    shape = tuple(int(tree["shape"][str(i)]) for i in range(len(tree["shape"])))
    chunks = tuple(tree["chunks"][str(i)] for i in range(len(tree["chunks"])))
    return ChunkedArray(shape, chunks)
  return {k: unchunk(v) for k, v in tree.items()}


def read_array(buf, a: InlineArray | ChunkedArray) -> np.ndarray:
  """A copy of one array's bytes in `buf`, shaped; ValueError if its byte
  count does not match its shape and dtype."""
  if isinstance(a, ChunkedArray):
    x = np.concatenate([read_array(buf, c).reshape(-1) for c in a.chunks])
    return x.reshape(a.shape)
  count = int(np.prod(a.shape, dtype=np.int64))
  if count * a.dtype.itemsize != a.span.length:
    raise ValueError(f"Inline array of shape {a.shape} {a.dtype} has {a.span.length} bytes")
  return np.frombuffer(buf, a.dtype, count, a.span.offset).reshape(a.shape).copy()


def top_level_keys(file: str) -> set | None:
  """Keys of the top-level msgpack map in `file`; None if it is not one.

  The file is memory-mapped and parsed as above, so no array is read.
  """
  with open(file, "rb") as f:
    head = f.read(1)
    if not head or not (0x80 <= head[0] <= 0x8f or head[0] in (0xde, 0xdf)):
      return None
    f.seek(0)
    size = os.fstat(f.fileno()).st_size
    with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as buf:
      try:
        tree, _ = MsgpackParser(buf).parse(0)
      except PARSE_ERRORS:
        return None
  return set(tree) if isinstance(tree, dict) else None
