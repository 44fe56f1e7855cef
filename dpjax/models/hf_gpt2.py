"""Hugging Face GPT-2 state dicts -> dpjax GPT-2 params (names and layouts).

The mapping reproduces Hugging Face's GPT-2 logits (tests/models/test_gpt2.py,
run where `transformers<5` is installed). No torch import: callers pass
numpy arrays.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dpjax.models.gpt2 import GPT2Config

PyTree = Any


def params_from_hf_state_dict(config: GPT2Config, state_dict: Mapping[str, Any]) -> PyTree:
  """Converts a Hugging Face PyTorch GPT-2 state dict to dpjax params.

  `state_dict` maps HF names (e.g. 'transformer.h.0.attn.c_attn.weight', or
  without the 'transformer.' prefix as saved by `GPT2Model`) to arrays
  (numpy, or anything `np.asarray` accepts: convert torch tensors with
  `.numpy()` first). GPT-2 uses Conv1D, whose weights are already `[in, out]`
  like our kernels; the fused `c_attn` is split into query, key and value.
  Raises KeyError on a missing weight and ValueError, naming the tensor and
  both shapes, on a shape mismatch, or on unused weights or an untied lm_head.
  """
  prefix = "transformer." if any(k.startswith("transformer.") for k in state_dict) else ""
  d, ff = config.d_model, config.mlp_dim
  used = set()

  def get(name, shape):
    full = prefix + name
    used.add(full)
    x = np.asarray(state_dict[full], np.float32)
    if x.shape != shape:
      raise ValueError(f"{full} has shape {x.shape}, expected {shape} for {config}")
    return x

  def dense(name, n_in, n_out):
    return {"kernel": get(f"{name}.weight", (n_in, n_out)), "bias": get(f"{name}.bias", (n_out,))}

  def norm(name):
    return {"scale": get(f"{name}.weight", (d,)), "bias": get(f"{name}.bias", (d,))}

  def layer(i):
    p = f"h.{i}"
    qkv = dense(f"{p}.attn.c_attn", d, 3 * d)
    kernels = np.split(qkv["kernel"], 3, axis=1)  # HF's order: query, key, value
    biases = np.split(qkv["bias"], 3)
    attention = {n: {"kernel": k, "bias": b}
                 for n, k, b in zip(("query", "key", "value"), kernels, biases)}
    attention["out"] = dense(f"{p}.attn.c_proj", d, d)
    return {"pre_attention_layer_norm": norm(f"{p}.ln_1"), "attention": attention,
            "pre_mlp_layer_norm": norm(f"{p}.ln_2"),
            "mlp": {"wi": dense(f"{p}.mlp.c_fc", d, ff), "wo": dense(f"{p}.mlp.c_proj", ff, d)}}

  params = {
      "token_embedder": {"embedding": get("wte.weight", (config.vocab_size, d))},
      "position_embedder": {"embedding": get("wpe.weight", (config.n_positions, d))},
      **{f"layers_{i}": layer(i) for i in range(config.num_layers)},
      "decoder_norm": norm("ln_f"),
  }
  # lm_head is tied to wte; older checkpoints also store the causal-mask
  # buffers `attn.bias` / `attn.masked_bias`, which carry no weights.
  ignored = {"lm_head.weight"} | {
      f"{prefix}h.{i}.attn.{b}" for i in range(config.num_layers)
      for b in ("bias", "masked_bias")}
  if "lm_head.weight" in state_dict and not np.array_equal(
      np.asarray(state_dict["lm_head.weight"], np.float32), params["token_embedder"]["embedding"]):
    raise ValueError("lm_head.weight differs from wte.weight; GPT-2 ties them.")
  unused = set(state_dict) - used - ignored
  if unused:
    raise ValueError(f"Unused weights in the state dict: {sorted(unused)}")
  return params
