"""Pretrained checkpoints -> dpjax params (and back to Hugging Face).

`load_pretrained(path, config)` reads either a Hugging Face checkpoint
directory (`hf.load_hf`: config.json + safetensors or PyTorch .bin; T5 v1.0 /
v1.1, GPT-2, BERT encoders) or a t5x checkpoint (`t5x.load_t5x`), streaming
one tensor at a time into (sharded) device arrays. `export_hf` writes params
as a Hugging Face directory. Every problem is a `CheckpointError` naming the
tensor or config field and both shapes or values. No TensorFlow here; torch
is imported only to read `.bin` files.
"""
from __future__ import annotations

import importlib
import os
import pathlib
from typing import Any

from dpjax.pretrained.hf import (CheckpointError, export_hf, load_hf, open_hf_checkpoint,
                                 tokenizer_files)

__all__ = ["CheckpointError", "export_hf", "load_hf", "load_pretrained", "open_hf_checkpoint",
           "tokenizer_files"]


def _t5x_module():
  """`dpjax.pretrained.t5x`, or None where it is not installed (yet)."""
  try:
    return importlib.import_module("dpjax.pretrained.t5x")
  except ModuleNotFoundError as e:
    if e.name != "dpjax.pretrained.t5x":
      raise  # the module exists but something it needs does not
    return None


def load_pretrained(path: str | os.PathLike, config, *, shardings=None) -> Any:
  """Params of `config`'s model from a Hugging Face directory or a t5x checkpoint.

  A dual encoder takes the encoder of a T5 checkpoint (`config.encoder`
  describes the whole T5, decoder included)."""
  from dpjax.models import dual_encoder  # pylint: disable=g-import-not-at-top
  if isinstance(config, dual_encoder.DualEncoderConfig):
    import jax  # pylint: disable=g-import-not-at-top
    params = dual_encoder.params_from_t5(load_pretrained(path, config.encoder))
    return params if shardings is None else jax.device_put(params, shardings)
  if (pathlib.Path(path) / "config.json").is_file():
    return load_hf(path, config, shardings=shardings)
  t5x = _t5x_module()
  if t5x is not None and t5x.is_t5x_checkpoint(path):
    return t5x.load_t5x(path, config, shardings=shardings)
  raise CheckpointError(
      f"{path} is neither a Hugging Face directory (config.json) nor a t5x checkpoint"
      + ("" if t5x is not None else " (t5x support is not available)"))
