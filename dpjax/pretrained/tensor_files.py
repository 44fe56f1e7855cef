"""Tensor files, one tensor at a time: safetensors and PyTorch `.bin` read,
safetensors written.

Readers (`SafetensorsReader`, `TorchReader`, `DictReader` over an in-memory
dict) are `hf_common.TensorReader`s: `keys` and `shape` come from the files'
headers, and `get(name)` reads that one tensor, upcast to float32 (a bf16/f16
tensor thus briefly takes 2-3x its stored size) and owned by the returned
array. Opening reads no tensor data: safetensors files are opened with
`safe_open` (the header only) and again per tensor; `.bin` files are
`torch.load(mmap=True, weights_only=True)`, so the file is paged in, not
copied, and a pickle holding anything but tensors is refused (a
`CheckpointError` saying how to convert it once to safetensors). torch and
safetensors are imported only when a reader of their files is made.

`write_safetensors` writes a `.safetensors` file one tensor at a time (the
format is a JSON header of dtypes, shapes and byte ranges, then the raw
little-endian data), to a temporary name renamed into place.
"""
from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import struct
from typing import Any, Iterable, Mapping

import ml_dtypes  # also registers bfloat16 with numpy (safetensors BF16)
import numpy as np

# transformers' name for a one-file safetensors checkpoint: where a refused
# `.bin` is best converted to.
SAFETENSORS_FILE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint that does not fit the model, or cannot be read."""


def _as_float32(x: np.ndarray) -> np.ndarray:
  return x if x.dtype == np.float32 else x.astype(np.float32)


class SafetensorsReader:
  """Tensors of one or more .safetensors files, each read when asked for."""

  def __init__(self, files: Iterable[str | os.PathLike]):
    from safetensors import safe_open  # lazy: only where safetensors are read
    self._safe_open = safe_open
    self._index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
      with safe_open(os.fspath(file), framework="np") as f:  # reads the header only
        for name in f.keys():
          self._index[name] = (os.fspath(file), tuple(f.get_slice(name).get_shape()))

  def keys(self) -> list[str]:
    """The names of the tensors of all the files."""
    return list(self._index)

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of tensor `name`, from its file's header."""
    return self._index[name][1]

  def get(self, name: str) -> np.ndarray:
    """Tensor `name`, read from its file, as float32."""
    file = self._index[name][0]
    with self._safe_open(file, framework="np") as f:
      return _as_float32(f.get_tensor(name))


def _unsafe_pickle_message(file: str, e: Exception) -> str:
  """Why torch's weights_only loader refused `file`, and how to convert it."""
  found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
  what = f"an object of type {found.group(1)}" if found else "a non-tensor object"
  target = os.path.join(os.path.dirname(file) or ".", SAFETENSORS_FILE)
  return (
      f"{file}: refused as unsafe: it holds {what}, and unpickling anything "
      "but tensors can run arbitrary code on load. If you trust the file, "
      f"convert it once to {SAFETENSORS_FILE} (read instead of the .bin): "
      "python -c \"import torch; from safetensors.torch import save_file; "
      f"sd = torch.load('{file}', weights_only=False); save_file({{k: "
      "v.clone().contiguous() for k, v in sd.items() if isinstance(v, "
      f"torch.Tensor)}}, '{target}')\" (or, sharded: transformers' "
      "from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True))")


class TorchReader:
  """Tensors of PyTorch `.bin` files, memory-mapped (torch imported here only)."""

  def __init__(self, files: Iterable[str | os.PathLike]):
    import torch  # lazy: heavy, and only for .bin files
    self._torch = torch
    self._tensors: dict[str, Any] = {}
    for file in files:
      try:
        try:
          state = torch.load(os.fspath(file), map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # the pre-1.6 (non-zip) format cannot be mapped
          state = torch.load(os.fspath(file), map_location="cpu", weights_only=True)
      except pickle.UnpicklingError as e:
        raise CheckpointError(_unsafe_pickle_message(os.fspath(file), e)) from None
      self._tensors.update(state)

  def keys(self) -> list[str]:
    """The names of the tensors of all the files."""
    return list(self._tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of tensor `name`."""
    return tuple(self._tensors[name].shape)

  def get(self, name: str) -> np.ndarray:
    """Tensor `name` as float32, owned by the array (not a view of the file)."""
    t = self._tensors[name]
    if t.dtype == self._torch.float32:
      return np.array(t.numpy())  # a copy: never hand out views of the mapped file
    return t.to(self._torch.float32).numpy()  # a new tensor, owned by its array


class DictReader:
  """A TensorReader over an in-memory {name: array} dict (tests, conversions)."""

  def __init__(self, tensors: Mapping[str, Any]):
    self._tensors = tensors

  def keys(self) -> list[str]:
    """The dict's names."""
    return list(self._tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of tensor `name`."""
    return tuple(np.shape(self._tensors[name]))

  def get(self, name: str) -> np.ndarray:
    """Tensor `name` as a float32 array."""
    return np.asarray(self._tensors[name], np.float32)


_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
              np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float64): "F64",
              np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


def write_safetensors(path: pathlib.Path, tensors: Mapping[str, np.ndarray]) -> None:
  """A .safetensors file written one tensor at a time (the format is a JSON
  header of dtypes, shapes and byte ranges, then the raw little-endian data)."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  names = sorted(tensors)
  for name in names:
    x = tensors[name]
    size = int(np.prod(x.shape)) * x.dtype.itemsize
    header[name] = {"dtype": _ST_DTYPES[x.dtype], "shape": list(x.shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  tmp = path.with_name(f".{path.name}.tmp")
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in names:
      x = tensors[name]
      f.write(np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes())
  os.replace(tmp, path)
