"""Pretrained checkpoints -> dpjax params (and back to Hugging Face).

`load_pretrained(path, config)` reads either a Hugging Face checkpoint
directory (`hf.load_hf`: config.json + safetensors or PyTorch .bin; T5 v1.0 /
v1.1, GPT-2, BERT encoders) or a t5x checkpoint (`t5x.load_t5x`), streaming
one tensor at a time into (sharded) device arrays; a GPT-2 whose gin
vocab_size exceeds the checkpoint's gets the extra embedding rows (`hf`'s
docstring). A GPT-2 with a discriminator head (`gpt2_disc`) takes its GPT-2
from the checkpoint and a freshly initialised head; a model with LoRA
adapters takes its base model from the checkpoint and fresh adapters (B =
0), or, from a PEFT LoRA directory (`peft`), the base model it names and its
adapters. A T5 with scanned layers (`T5Config.scan_layers`) reads the
checkpoint's unrolled layers and stacks them (`t5.scan_params`). `export_hf` writes params
as a Hugging Face directory. Every problem is a `CheckpointError` naming the
tensor or config field and both shapes or values. No TensorFlow here; torch
is imported only to read `.bin` files.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Mapping

import jax
from jax.sharding import PartitionSpec as P

from dpjax.training import reporting
from dpjax.models import dual_encoder, gpt2_disc, lora, t5, trainable
from dpjax.pretrained import peft, t5x
from dpjax.pretrained.hf import (CheckpointError, export_hf, load_hf, open_hf_checkpoint,
                                 tokenizer_files)

# Adapters do not depend on the sequence lengths the model is built for.
_LENGTHS = {"inputs": 1, "targets": 1}

__all__ = ["CheckpointError", "export_hf", "load_hf", "load_pretrained", "open_hf_checkpoint",
           "resolve_base", "tokenizer_files"]


def load_pretrained(path: str | os.PathLike, config, *, shardings=None, rng=None,
                    base_path: str | os.PathLike | None = None) -> Any:
  """Params of `config`'s model from a Hugging Face directory or a t5x checkpoint.

  `path` may be a PEFT LoRA directory (`peft`): its adapters on the base
  model at `base_path` (default: its `base_model_name_or_path`, if that is a
  local directory), which must have the weights the directory's
  `peft.BASE_MODEL_FILE` fingerprints.

  A dual encoder takes the encoder of a T5 checkpoint (`config.encoder`
  describes the whole T5, decoder included). A `GPT2DiscConfig` model takes
  its GPT-2 (`config.lm`) from a GPT-2 checkpoint and initialises the
  discriminator head from `rng`, which it then needs (the trainer's
  `PRNGKey(seed)`: the head is the one `gpt2_disc.init_params(config, rng)`
  gives, as in a run without a checkpoint).
  """
  if getattr(config, "scan_layers", False):
    return _load_scanned(path, config, shardings, rng, base_path)
  if isinstance(config, dual_encoder.DualEncoderConfig):
    params = dual_encoder.params_from_t5(load_pretrained(path, config.encoder, rng=rng))
    return params if shardings is None else jax.device_put(params, shardings)
  if isinstance(config, gpt2_disc.GPT2DiscConfig):
    return _load_gpt2_disc(path, config, shardings, rng)
  if getattr(config, "lora", None) is not None:
    if peft.is_adapter_dir(path):
      return _load_peft(path, config, shardings, base_path)
    return _load_with_adapters(path, config, shardings, rng)
  if (pathlib.Path(path) / "config.json").is_file():
    return load_hf(path, config, shardings=shardings)
  if t5x.is_t5x_checkpoint(path):
    return t5x.load_t5x(path, config, shardings=shardings)
  raise CheckpointError(
      f"{path} is neither a Hugging Face directory (config.json) nor a t5x checkpoint")


def _load_scanned(path, config, shardings, rng, base_path=None) -> Any:
  """The unrolled model's params from the checkpoint, each layer placed as
  its slice of the stacked param will be, then stacked into place."""
  unrolled = dataclasses.replace(config, scan_layers=False)
  if not isinstance(shardings, Mapping):
    return t5.scan_params(load_pretrained(path, unrolled, shardings=shardings,
                                          rng=rng, base_path=base_path))
  per_layer = t5.unscan_params(
      shardings, layers={"encoder": config.num_encoder_layers,
                         "decoder": config.num_decoder_layers},
      take=lambda s, i: jax.sharding.NamedSharding(s.mesh, P(*s.spec[1:])))
  params = load_pretrained(path, unrolled, shardings=per_layer, rng=rng,
                           base_path=base_path)
  return jax.jit(t5.scan_params, out_shardings=shardings)(params)


def _load_gpt2_disc(path, config, shardings, rng) -> Any:
  """GPT-2 from the checkpoint, `disc_head` (and the GPT-2's LoRA adapters,
  if any) initialised from `rng`."""
  if rng is None:
    raise ValueError("a GPT2DiscConfig model needs rng= to initialise its discriminator "
                     f"head ({gpt2_disc.HEAD}), which a GPT-2 checkpoint does not hold")
  if isinstance(shardings, Mapping):
    lm_shardings, head_shardings = gpt2_disc.lm_params(shardings), shardings[gpt2_disc.HEAD]
    lm_shardings, adapter_shardings = lora.split(lm_shardings)
  else:
    lm_shardings = head_shardings = adapter_shardings = shardings
  params = load_pretrained(path, dataclasses.replace(config.lm, lora=None),
                           shardings=lm_shardings)

  def fresh(key):  # jitted, so XLA drops the rest of the init
    init = gpt2_disc.init_params(config, key, max_length=1)[0]
    return init[gpt2_disc.HEAD], lora.split(gpt2_disc.lm_params(init))[1]

  head, adapters = jax.jit(fresh)(rng)
  if head_shardings is not None:
    head = jax.device_put(head, head_shardings)
    adapters = jax.device_put(adapters, adapter_shardings)
  reporting.say(f"{gpt2_disc.HEAD}{' and LoRA adapters' if adapters else ''}: not in "
                "the checkpoint, freshly initialised from the run's key")
  return {**lora.merge(params, adapters), gpt2_disc.HEAD: head}


def _load_with_adapters(path, config, shardings, rng) -> Any:
  """The base model from the checkpoint, LoRA adapters initialised from `rng`
  (B = 0: the adapted model starts as the checkpoint's)."""
  if rng is None:
    raise ValueError("a model with LoRA adapters needs rng= to initialise them")
  trainable_model = trainable.trainable(config, _LENGTHS)
  adapters = jax.jit(lambda key: lora.split(
      trainable_model.init_params(key)[0])[1])(rng)
  params = _base_with_adapters(path, config, shardings, adapters)
  reporting.say("LoRA adapters: not in the checkpoint, initialised from the run's key "
                "(B = 0)")
  return params


def _load_peft(path, config, shardings, base_path=None) -> Any:
  """The base model (`resolve_base`), checked against the directory's
  fingerprint (`peft.check_base`), with its adapters
  (`peft.load_adapters`) and any grown embedding rows it carries
  (`peft.load_embeddings`)."""
  base_path = resolve_base(path, base_path)
  peft.check_base(path, base_path)
  params = _base_with_adapters(base_path, config, shardings,
                               peft.load_adapters(path, config))
  for param, table in peft.load_embeddings(path, config).items():
    node = params
    for key in param[:-1]:
      node = node[key]
    old = node[param[-1]]
    node[param[-1]] = jax.device_put(table.astype(old.dtype), old.sharding)
  reporting.say(f"LoRA adapters: from {path}, on the base model {base_path}")
  return params


def resolve_base(path, base_path=None) -> str | os.PathLike:
  """The base model directory of the PEFT LoRA directory `path`: `base_path`
  if given, else its `base_model_name_or_path` if that is a local directory;
  a one-line CheckpointError naming the base and its fingerprint if
  neither."""
  if base_path is not None:
    return base_path
  name = peft.read_adapter_config(path).get("base_model_name_or_path")
  if not name or not pathlib.Path(name).is_dir():
    digests = peft.read_base_record(path).get("weights_sha256") or {}
    fingerprint = "".join(f", {k} sha256 {v}" for k, v in sorted(digests.items()))
    raise CheckpointError(
        f"{path}: its base model {name!r}{fingerprint} is not a local checkpoint; "
        "give its directory (a run's train.initial_checkpoint_base_path, "
        "load_pretrained's base_path)")
  return name


def _base_with_adapters(base_path, config, shardings, adapters) -> Any:
  """`config`'s base model (no LoRA) read from `base_path`, merged with
  `adapters`; both placed by `shardings` (one sharding, or params-shaped)."""
  base_shardings, adapter_shardings = (lora.split(shardings)
                                       if isinstance(shardings, Mapping)
                                       else (shardings, shardings))
  base = load_pretrained(base_path, dataclasses.replace(config, lora=None),
                         shardings=base_shardings)
  return lora.merge(base, jax.device_put(adapters, adapter_shardings))
