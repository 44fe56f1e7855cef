"""Hugging Face T5 state dicts -> dpjax T5 params (names and layouts).

A start on importing pretrained checkpoints: the mapping reproduces Hugging
Face's T5 logits (tests/models/test_hf.py, run where `transformers<5` is
installed). No torch import: callers pass numpy arrays.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from dpjax.models.t5 import T5Config, abstract_params

PyTree = Any


def params_from_hf_state_dict(config: T5Config, state_dict: Mapping[str, Any]) -> PyTree:
  """Converts a Hugging Face PyTorch T5 state dict to dpjax params.

  `state_dict` maps HF names (e.g. 'encoder.block.0.layer.0.SelfAttention.q.weight')
  to arrays (numpy, or anything `np.asarray` accepts, so no torch import is
  needed here: convert the tensors with `.numpy()` first). PyTorch linear
  weights are `[out, in]`, so kernels are their transposes. Raises KeyError
  on a missing weight and ValueError on unused ones or shape mismatches.
  """
  used = set()

  def get(name, transpose=False):
    used.add(name)
    x = np.asarray(state_dict[name], np.float32)
    return x.T if transpose else x

  def attention(prefix):
    return {ours: {"kernel": get(f"{prefix}.{hf}.weight", transpose=True)}
            for ours, hf in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))}

  def mlp(prefix):
    names = ("wi", "wo") if config.feed_forward == "relu" else ("wi_0", "wi_1", "wo")
    return {n: {"kernel": get(f"{prefix}.DenseReluDense.{n}.weight", transpose=True)}
            for n in names}

  def norm(name):
    return {"scale": get(name)}

  def stack(kind, num_layers, sublayers):
    out = {f"layers_{i}": {ours: build(f"{kind}.block.{i}.layer.{j}")
                           for j, group in enumerate(sublayers) for ours, build in group}
           for i in range(num_layers)}
    bias = f"{kind}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    out["relpos_bias"] = {"rel_embedding": get(bias, transpose=True)}
    out[f"{kind}_norm"] = norm(f"{kind}.final_layer_norm.weight")
    return out

  params = {
      "token_embedder": {"embedding": get("shared.weight")},
      "encoder": stack("encoder", config.num_encoder_layers, [
          [("pre_attention_layer_norm", lambda p: norm(f"{p}.layer_norm.weight")),
           ("attention", lambda p: attention(f"{p}.SelfAttention"))],
          [("pre_mlp_layer_norm", lambda p: norm(f"{p}.layer_norm.weight")), ("mlp", mlp)],
      ]),
      "decoder": stack("decoder", config.num_decoder_layers, [
          [("pre_self_attention_layer_norm", lambda p: norm(f"{p}.layer_norm.weight")),
           ("self_attention", lambda p: attention(f"{p}.SelfAttention"))],
          [("pre_cross_attention_layer_norm", lambda p: norm(f"{p}.layer_norm.weight")),
           ("encoder_decoder_attention", lambda p: attention(f"{p}.EncDecAttention"))],
          [("pre_mlp_layer_norm", lambda p: norm(f"{p}.layer_norm.weight")), ("mlp", mlp)],
      ]),
  }
  if not config.tie_embeddings:
    params["decoder"]["logits_dense"] = {"kernel": get("lm_head.weight", transpose=True)}

  # Copies of the shared embedding (and a tied lm_head) carry no new weights;
  # some original checkpoints also hold a cross-attention bias HF never uses.
  aliases = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
             "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"}
  if config.tie_embeddings:
    aliases.add("lm_head.weight")
  unused = set(state_dict) - used - aliases
  if unused:
    raise ValueError(f"Unused weights in the state dict: {sorted(unused)}")
  expected, _ = abstract_params(config, input_length=1, target_length=1)
  mismatched = [
      (jax.tree_util.keystr(path), x.shape, e.shape)
      for (path, x), e in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(expected)) if x.shape != e.shape]
  if jax.tree.structure(params) != jax.tree.structure(expected) or mismatched:
    raise ValueError(f"State dict does not fit {config}: {mismatched}")
  return params
