"""Hugging Face GPT-2 checkpoints <-> dpjax GPT-2 params: names, layouts, config.

Follows the mapping contract of `dpjax.models.hf_t5`. GPT-2 uses Conv1D,
whose weights are already `[in, out]` like our kernels; the fused `c_attn`
(`[d, 3d]`, HF's order query, key, value) is split into three kernels, each
read from the one tensor. Names may carry the `transformer.` prefix
(`GPT2LMHeadModel`) or not (`GPT2Model`); export writes the prefixed form.
`lm_head.weight` is always tied to `wte` (config.json must not untie it) and
the causal-mask buffers `attn.bias` / `attn.masked_bias` of old checkpoints
carry no weights: all are aliases. The token embedding (and so the tied LM
head) is in `VOCAB_PARAMS`: a gin vocab_size larger than the checkpoint's
grows it on import (`dpjax.pretrained.hf`), for tokens appended to GPT-2's
BPE. No torch here.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from dpjax.models import hf_common
from dpjax.models.gpt2 import GPT2Config

PyTree = Any
# PEFT adapter_config.json: the task, and whether weights are [in, out].
PEFT_TASK_TYPE = "CAUSAL_LM"
PEFT_FAN_IN_FAN_OUT = True
HF_MODEL_TYPES = ("gpt2",)
HF_FIELD_NAMES = {"d_model": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
                  "d_ff": "n_inner", "dropout_rate": "resid_pdrop"}
# "gelu_pytorch_tanh" is the same tanh-approximated GELU as "gelu_new".
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Params whose first axis is `vocab_size`: they may grow on import.
VOCAB_PARAMS = (("token_embedder", "embedding"),)
# GPT-2's <|endoftext|>: the last of its BPE's tokens, before any appended ones.
_ENDOFTEXT = 50256


def config_from_hf(hf: Mapping[str, Any]) -> GPT2Config:
  """A GPT2Config from a config.json dict (HF defaults for absent keys)."""
  unsupported = {"activation_function": (hf.get("activation_function", "gelu_new"), _ACTIVATIONS),
                 "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
                 "scale_attn_by_inverse_layer_idx": (
                     hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
                 "add_cross_attention": (hf.get("add_cross_attention", False), (False,)),
                 "tie_word_embeddings": (hf.get("tie_word_embeddings", True), (True,))}
  for key, (value, allowed) in unsupported.items():
    if value not in allowed:
      raise ValueError(f"{key}: config.json {value!r}, dpjax GPT-2 supports {allowed}")
  return GPT2Config(
      vocab_size=hf.get("vocab_size", 50257), n_positions=hf.get("n_positions", 1024),
      d_model=hf.get("n_embd", 768), num_layers=hf.get("n_layer", 12),
      num_heads=hf.get("n_head", 12), d_ff=hf.get("n_inner"),
      dropout_rate=hf.get("resid_pdrop", 0.1),
      layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5))


def config_to_hf(config: GPT2Config) -> dict:
  """A config.json that transformers loads as this model (GPT2LMHeadModel).

  BOS/EOS are <|endoftext|>: 50256 where the vocabulary is GPT-2's, grown or
  not; a smaller (e.g. test) vocabulary is taken to end with it, as GPT-2's does.
  """
  eos = min(config.vocab_size - 1, _ENDOFTEXT)
  return {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "vocab_size": config.vocab_size, "n_positions": config.n_positions,
      "n_embd": config.d_model, "n_layer": config.num_layers, "n_head": config.num_heads,
      "n_inner": config.d_ff, "activation_function": "gelu_new",
      "resid_pdrop": config.dropout_rate, "embd_pdrop": config.dropout_rate,
      "attn_pdrop": config.dropout_rate, "layer_norm_epsilon": config.layer_norm_epsilon,
      "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
      "bos_token_id": eos, "eos_token_id": eos,
  }


def _plain(config: GPT2Config):
  """(param path, HF name without prefix) of every tensor read as is."""
  yield ("token_embedder", "embedding"), "wte.weight"
  yield ("position_embedder", "embedding"), "wpe.weight"
  for i in range(config.num_layers):
    p, layer = f"h.{i}", f"layers_{i}"
    for ours, theirs in (("pre_attention_layer_norm", "ln_1"), ("pre_mlp_layer_norm", "ln_2")):
      yield (layer, ours, "scale"), f"{p}.{theirs}.weight"
      yield (layer, ours, "bias"), f"{p}.{theirs}.bias"
    for path, theirs in ((("attention", "out"), "attn.c_proj"), (("mlp", "wi"), "mlp.c_fc"),
                         (("mlp", "wo"), "mlp.c_proj")):
      yield (layer, *path, "kernel"), f"{p}.{theirs}.weight"
      yield (layer, *path, "bias"), f"{p}.{theirs}.bias"
  yield ("decoder_norm", "scale"), "ln_f.weight"
  yield ("decoder_norm", "bias"), "ln_f.bias"


_QKV = ("query", "key", "value")  # HF's order within c_attn


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def param_sources(config: GPT2Config, reader: hf_common.TensorReader
                  ) -> tuple[PyTree, set[str]]:
  """Params-shaped tree of `Source`s, and the checkpoint names that are aliases."""
  keys = set(reader.keys())
  prefix = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
  d = config.d_model
  tree: dict = {}
  for path, name in _plain(config):
    _set(tree, path, hf_common.tensor(reader, prefix + name))

  def third(j):
    def take(x):  # a view of the one c_attn tensor loaded
      if x.shape[-1] != 3 * d:
        raise ValueError(f"its fused query/key/value axis is {x.shape[-1]}, not 3 * {d}")
      return x[..., j * d:(j + 1) * d]
    return take

  for i in range(config.num_layers):
    for j, ours in enumerate(_QKV):
      for part, suffix in (("kernel", "weight"), ("bias", "bias")):
        _set(tree, (f"layers_{i}", "attention", ours, part),
             hf_common.tensor(reader, f"{prefix}h.{i}.attn.c_attn.{suffix}", third(j)))
  aliases = {"lm_head.weight"} | {f"{prefix}h.{i}.attn.{b}" for i in range(config.num_layers)
                                  for b in ("bias", "masked_bias")}
  return tree, aliases


def to_hf_state_dict(config: GPT2Config, params: PyTree) -> dict[str, np.ndarray]:
  """dpjax params -> the GPT2LMHeadModel tensors (prefixed, no lm_head)."""
  def get(path):
    x = params
    for key in path:
      x = x[key]
    return np.asarray(x)

  out = {f"transformer.{name}": get(path) for path, name in _plain(config)}
  for i in range(config.num_layers):
    attention = (f"layers_{i}", "attention")
    for part, suffix in (("kernel", "weight"), ("bias", "bias")):
      out[f"transformer.h.{i}.attn.c_attn.{suffix}"] = np.concatenate(
          [get((*attention, n, part)) for n in _QKV], axis=-1)
  return out


def lora_modules(config: GPT2Config) -> Iterator[tuple[str, list[tuple[tuple, int]]]]:
  """(HF module name, [(our projection's path, its first output column)]) of
  every dense projection a LoRA adapter can sit on (PEFT's layout): HF's
  `c_attn` is query, key and value side by side, columns 0, d and 2d."""
  d = config.d_model
  for i in range(config.num_layers):
    p, layer = f"transformer.h.{i}", f"layers_{i}"
    yield f"{p}.attn.c_attn", [((layer, "attention", n), j * d) for j, n in enumerate(_QKV)]
    for path, theirs in ((("attention", "out"), "attn.c_proj"), (("mlp", "wi"), "mlp.c_fc"),
                         (("mlp", "wo"), "mlp.c_proj")):
      yield f"{p}.{theirs}", [((layer, *path), 0)]

