"""What the checkpoint name mappings (hf_t5, hf_gpt2, hf_bert, t5x) share.

A mapping turns a checkpoint into a pytree shaped like the model's params
whose leaves are `Source`s: the checkpoint tensors a parameter is made from
and a function that loads and reshapes them. The loader
(`dpjax.pretrained`) then materialises one leaf at a time straight into its
(sharded) device array, so host memory holds one tensor, not the model.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Protocol

import numpy as np


class TensorReader(Protocol):
  """Random access to a checkpoint's tensors by name (e.g. safetensors)."""

  def keys(self) -> Iterable[str]:
    """The names of the checkpoint's tensors."""

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of tensor `name`, without reading its data."""

  def get(self, name: str) -> np.ndarray:
    """Tensor `name` as a float32 array."""


@dataclasses.dataclass(frozen=True)
class Source:
  """One dpjax parameter: the tensors it reads and how to build it."""
  names: tuple[str, ...]
  load: Callable[[], np.ndarray]


def tensor(reader: TensorReader, name: str,
           transform: Callable[[np.ndarray], np.ndarray] | None = None
           ) -> Source:
  """A parameter read from one checkpoint tensor, optionally transformed."""
  fn = transform or (lambda x: x)
  return Source((name,), lambda: np.asarray(fn(reader.get(name)), np.float32))
