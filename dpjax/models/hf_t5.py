"""Hugging Face T5 checkpoints <-> dpjax T5 params: names, layouts, config.

The mapping contract shared by all `hf_*` modules (see `dpjax.pretrained.hf`,
which does the file reading, checking and device placement):
`HF_MODEL_TYPES`, `config_from_hf`, `config_to_hf`, `param_sources` (lazy:
nothing is read here), `to_hf_state_dict` (its exact inverse) and
`lora_modules` (where PEFT's adapters sit).

PyTorch `nn.Linear` weights are `[out, in]`, our kernels `[in, out]`, so
kernels are transposes; the relative position tables are `[buckets, heads]`
in HF and `[heads, buckets]` here. The encoder/decoder `embed_tokens` (and,
for tied models, `lm_head`) are aliases of `shared.weight`. Since
transformers 5 a T5.1.1 config says `"scale_decoder_outputs": false` (and
`tie_word_embeddings: true`); older ones say `"tie_word_embeddings": false`.
Either means our `tie_embeddings=False`: no d_model**-0.5 logit scaling and a
separate `logits_dense`, read from `lm_head.weight` (or from `shared.weight`
when the checkpoint has no separate head, as transformers 5 writes a model
whose head is tied). No torch here: tensors come from a `TensorReader`.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from dpjax.models import hf_common
from dpjax.models.t5 import T5Config

PyTree = Any
# PEFT adapter_config.json: the task, and whether weights are [in, out].
PEFT_TASK_TYPE = "SEQ_2_SEQ_LM"
PEFT_FAN_IN_FAN_OUT = False
HF_MODEL_TYPES = ("t5",)
# dpjax field -> config.json key, for error messages.
HF_FIELD_NAMES = {"num_encoder_layers": "num_layers", "feed_forward": "feed_forward_proj",
                  "tie_embeddings": "scale_decoder_outputs/tie_word_embeddings"}
_EPS = 1e-6  # dpjax's T5 LayerNorm epsilon


def config_from_hf(hf: Mapping[str, Any]) -> T5Config:
  """A T5Config from a config.json dict (HF defaults for absent keys)."""
  ff = hf.get("feed_forward_proj", "relu")
  if ff not in ("relu", "gated-gelu"):
    raise ValueError(f"feed_forward_proj {ff!r} is not supported (only 'relu', 'gated-gelu')")
  if hf.get("layer_norm_epsilon", _EPS) != _EPS:
    raise ValueError(f"layer_norm_epsilon: config.json {hf['layer_norm_epsilon']}, "
                     f"dpjax T5 uses {_EPS}")
  layers = hf.get("num_layers", 6)
  decoder_layers = hf.get("num_decoder_layers")
  return T5Config(
      vocab_size=hf.get("vocab_size", 32128), d_model=hf.get("d_model", 512),
      d_kv=hf.get("d_kv", 64), d_ff=hf.get("d_ff", 2048), num_heads=hf.get("num_heads", 8),
      num_encoder_layers=layers,
      num_decoder_layers=layers if decoder_layers is None else decoder_layers,
      dropout_rate=hf.get("dropout_rate", 0.1),
      relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
      relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
      feed_forward=ff,
      tie_embeddings=bool(hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))))


def config_to_hf(config: T5Config) -> dict:
  """A config.json that transformers 4 and 5 load as this model."""
  return {
      "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
      "vocab_size": config.vocab_size, "d_model": config.d_model, "d_kv": config.d_kv,
      "d_ff": config.d_ff, "num_heads": config.num_heads,
      "num_layers": config.num_encoder_layers, "num_decoder_layers": config.num_decoder_layers,
      "relative_attention_num_buckets": config.relative_attention_num_buckets,
      "relative_attention_max_distance": config.relative_attention_max_distance,
      "dropout_rate": config.dropout_rate, "layer_norm_epsilon": _EPS,
      "feed_forward_proj": config.feed_forward, "initializer_factor": 1.0,
      "tie_word_embeddings": config.tie_embeddings,
      "scale_decoder_outputs": config.tie_embeddings,
      "is_encoder_decoder": True, "pad_token_id": 0, "eos_token_id": 1,
      "decoder_start_token_id": 0,
  }


def _table(config: T5Config, has_lm_head: bool = True) -> Iterator[tuple[tuple, str, bool]]:
  """(param path, HF tensor name, transposed?) for every parameter."""
  mlp = (("wi", "wi"), ("wo", "wo")) if config.feed_forward == "relu" else (
      ("wi_0", "wi_0"), ("wi_1", "wi_1"), ("wo", "wo"))
  attn = (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))
  sublayers = {
      "encoder": [("pre_attention_layer_norm", "attention", "SelfAttention", attn),
                  ("pre_mlp_layer_norm", "mlp", "DenseReluDense", mlp)],
      "decoder": [("pre_self_attention_layer_norm", "self_attention", "SelfAttention", attn),
                  ("pre_cross_attention_layer_norm", "encoder_decoder_attention",
                   "EncDecAttention", attn),
                  ("pre_mlp_layer_norm", "mlp", "DenseReluDense", mlp)],
  }
  yield ("token_embedder", "embedding"), "shared.weight", False
  for kind, subs in sublayers.items():
    n = config.num_encoder_layers if kind == "encoder" else config.num_decoder_layers
    for i in range(n):
      for j, (norm, block, hf_block, denses) in enumerate(subs):
        p = f"{kind}.block.{i}.layer.{j}"
        yield (kind, f"layers_{i}", norm, "scale"), f"{p}.layer_norm.weight", False
        for ours, theirs in denses:
          yield (kind, f"layers_{i}", block, ours, "kernel"), f"{p}.{hf_block}.{theirs}.weight", True
    yield ((kind, "relpos_bias", "rel_embedding"),
           f"{kind}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True)
    yield (kind, f"{kind}_norm", "scale"), f"{kind}.final_layer_norm.weight", False
  if not config.tie_embeddings:
    yield (("decoder", "logits_dense", "kernel"),
           "lm_head.weight" if has_lm_head else "shared.weight", True)


def param_sources(config: T5Config, reader: hf_common.TensorReader
                  ) -> tuple[PyTree, set[str]]:
  """Params-shaped tree of `Source`s, and the checkpoint names that are aliases."""
  has_lm_head = "lm_head.weight" in set(reader.keys())
  tree: dict = {}
  for path, name, transposed in _table(config, has_lm_head):
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = hf_common.tensor(reader, name, np.transpose if transposed else None)
  # Copies of the shared embedding (and a tied lm_head) carry no new weights;
  # some original checkpoints also hold a cross-attention bias HF never uses.
  aliases = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
             "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"}
  if config.tie_embeddings:
    aliases.add("lm_head.weight")
  return tree, aliases


def to_hf_state_dict(config: T5Config, params: PyTree) -> dict[str, np.ndarray]:
  """dpjax params -> the T5ForConditionalGeneration tensors (no aliases)."""
  out = {}
  for path, name, transposed in _table(config):
    x = params
    for key in path:
      x = x[key]
    x = np.asarray(x)
    out[name] = x.T if transposed else x
  return out


def lora_modules(config: T5Config) -> Iterator[tuple[str, list[tuple[tuple, int]]]]:
  """(HF module name, [(our projection's path, its first output column)]) of
  every dense projection a LoRA adapter can sit on (PEFT's layout,
  `dpjax.pretrained.peft`): in T5 each projection is its own `nn.Linear`."""
  for path, name, transposed in _table(config):
    if transposed and path[-1] == "kernel" and "relpos_bias" not in path and (
        path[-2] != "logits_dense"):
      yield name[:-len(".weight")], [(path[:-1], 0)]

