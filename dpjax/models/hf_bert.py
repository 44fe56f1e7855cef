"""Hugging Face BERT checkpoints <-> dpjax BERT params (names and layouts).

The mapping reproduces `transformers`' `BertForSequenceClassification`
logits and `BertModel` hidden states (tests/models/test_bert.py). No torch
import: tensors come through a `hf_common.TensorReader` and leave as numpy.

* `param_sources(config, reader)` covers exactly the params of
  `bert.BertClassifier`: a `BertForSequenceClassification` checkpoint (names
  'bert.…' plus 'classifier.…'; 'bert.' may also be absent from the encoder
  names).
* `param_sources(config, reader, encoder_only=True)` covers only
  `params['encoder']` (and `params['pooler']` when `pooling="cls"`): for a
  plain `BertModel` checkpoint (e.g. bert-base-uncased, with or without the
  'bert.' prefix) under a classifier whose head is trained from scratch.
  Materialise the sources and merge them over freshly initialised params:
  `params = {**bert.init_params(...)[0], **loaded}` (the split is at the top
  level). Task heads in the checkpoint ('cls.…' of BertForPreTraining /
  MaskedLM, 'classifier.…', anything outside 'bert.'), and with
  `pooling="mean"` the pooler, are returned as ignorable names. (The generic
  loader `dpjax.pretrained.hf` calls `param_sources(config, reader)`, so as
  it stands it loads full classifier checkpoints only.)

Always ignorable: the `embeddings.position_ids` / `token_type_ids` buffers
that older checkpoints store. LayerNorm tensors are also found under their
legacy TF-converted names '…LayerNorm.gamma' / '…LayerNorm.beta'.
PyTorch Linear weights are `[out, in]`; our kernels are their transposes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from dpjax.models import hf_common
from dpjax.models.bert import BertConfig

PyTree = Any

HF_MODEL_TYPES = ("bert",)
_PREFIX = "bert."
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
_LEGACY = {"LayerNorm.weight": "LayerNorm.gamma", "LayerNorm.bias": "LayerNorm.beta"}


# ----------------------------------------------------------------------------
# Configs.
# ----------------------------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any]) -> BertConfig:
  """A `BertConfig` from a Hugging Face BERT `config.json` dict.

  One dropout rate: `hidden_dropout_prob` (attention_probs_dropout_prob and
  classifier_dropout are not read). `num_labels` is the size of `id2label`
  (or `num_labels`), default 2. Raises ValueError for what this model cannot
  reproduce: another model_type, a `hidden_act` other than "gelu" (exact
  GELU), relative position embeddings, or a decoder.
  """
  model_type = hf.get("model_type", "bert")
  if model_type not in HF_MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r} is not one of {HF_MODEL_TYPES}")
  if hf.get("hidden_act", "gelu") != "gelu":
    raise ValueError(f"hidden_act must be 'gelu' (exact GELU), got {hf['hidden_act']!r}")
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise ValueError("Only absolute position embeddings are supported, got "
                     f"{hf['position_embedding_type']!r}")
  if hf.get("is_decoder") or hf.get("add_cross_attention"):
    raise ValueError("BERT decoders / cross-attention are not supported.")
  if hf.get("id2label"):
    num_labels = len(hf["id2label"])
  else:
    num_labels = hf.get("num_labels", BertConfig.num_labels)
  defaults = BertConfig()
  return BertConfig(
      vocab_size=hf["vocab_size"],
      max_position_embeddings=hf.get("max_position_embeddings",
                                     defaults.max_position_embeddings),
      type_vocab_size=hf.get("type_vocab_size", defaults.type_vocab_size),
      d_model=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=hf["num_attention_heads"],
      d_ff=hf["intermediate_size"],
      dropout_rate=hf.get("hidden_dropout_prob", defaults.dropout_rate),
      layer_norm_epsilon=hf.get("layer_norm_eps", defaults.layer_norm_epsilon),
      num_labels=num_labels,
  )


def config_to_hf(config: BertConfig) -> dict:
  """A `config.json` dict that transformers loads as BertForSequenceClassification."""
  _check_exportable(config)
  labels = {str(i): f"LABEL_{i}" for i in range(config.num_labels)}
  return {
      "architectures": ["BertForSequenceClassification"],
      "model_type": "bert",
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "intermediate_size": config.d_ff,
      "hidden_act": "gelu",
      "hidden_dropout_prob": config.dropout_rate,
      "attention_probs_dropout_prob": config.dropout_rate,
      "max_position_embeddings": config.max_position_embeddings,
      "type_vocab_size": config.type_vocab_size,
      "initializer_range": 0.02,
      "layer_norm_eps": config.layer_norm_epsilon,
      "pad_token_id": 0,
      "position_embedding_type": "absolute",
      "id2label": labels,
      "label2id": {v: int(k) for k, v in labels.items()},
  }


def _check_exportable(config: BertConfig):
  if config.pooling != "cls":
    raise ValueError(f"pooling={config.pooling!r} has no Hugging Face BERT equivalent; "
                     "only pooling='cls' (BertPooler) can be exported.")


# ----------------------------------------------------------------------------
# The name table, shared by import and export.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
  path: tuple[str, ...]  # in the dpjax params tree
  name: str  # HF name; relative to BertModel when in_bert
  transpose: bool  # kernel = weight.T
  shape: tuple[int, ...]  # dpjax shape
  in_bert: bool = True


def _table(config: BertConfig, encoder_only: bool) -> list[_Entry]:
  d, ff = config.d_model, config.d_ff
  out = []

  def dense(path, name, n_in, n_out, in_bert=True):
    out.append(_Entry(path + ("kernel",), f"{name}.weight", True, (n_in, n_out), in_bert))
    out.append(_Entry(path + ("bias",), f"{name}.bias", False, (n_out,), in_bert))

  def norm(path, name):
    out.append(_Entry(path + ("scale",), f"{name}.weight", False, (d,)))
    out.append(_Entry(path + ("bias",), f"{name}.bias", False, (d,)))

  enc = ("encoder",)
  for ours, theirs, rows in (("token_embedder", "word_embeddings", config.vocab_size),
                             ("position_embedder", "position_embeddings",
                              config.max_position_embeddings),
                             ("token_type_embedder", "token_type_embeddings",
                              config.type_vocab_size)):
    out.append(_Entry(enc + (ours, "embedding"), f"embeddings.{theirs}.weight", False, (rows, d)))
  norm(enc + ("embedding_norm",), "embeddings.LayerNorm")
  for i in range(config.num_layers):
    ours, theirs = enc + (f"layers_{i}",), f"encoder.layer.{i}"
    for proj in ("query", "key", "value"):
      dense(ours + ("attention", proj), f"{theirs}.attention.self.{proj}", d, d)
    dense(ours + ("attention", "out"), f"{theirs}.attention.output.dense", d, d)
    norm(ours + ("post_attention_layer_norm",), f"{theirs}.attention.output.LayerNorm")
    dense(ours + ("mlp", "wi"), f"{theirs}.intermediate.dense", d, ff)
    dense(ours + ("mlp", "wo"), f"{theirs}.output.dense", ff, d)
    norm(ours + ("post_mlp_layer_norm",), f"{theirs}.output.LayerNorm")
  if config.pooling == "cls":
    dense(("pooler",), "pooler.dense", d, d)
  if not encoder_only:
    dense(("classifier",), "classifier", d, config.num_labels, in_bert=False)
  return out


def _set(tree: dict, path: tuple[str, ...], value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


# ----------------------------------------------------------------------------
# Import.
# ----------------------------------------------------------------------------


def param_sources(config: BertConfig, reader: hf_common.TensorReader, *,
                  encoder_only: bool = False) -> tuple[PyTree, set[str]]:
  """`(sources, ignorable)`: a tree of `hf_common.Source`s shaped like the params
  and the checkpoint names that carry nothing for them.

  Without `encoder_only` the tree is exactly `BertClassifier`'s params; with
  it only `{'encoder', 'pooler'}` (no pooler for pooling="mean"), see the
  module docstring. Lazy, like the other mappings: nothing is read or checked
  here; a missing tensor (named as the model expects it, e.g.
  'classifier.weight' for a plain BertModel checkpoint without
  `encoder_only`) raises KeyError only on `Source.load()`, and shapes are left
  to the loader (`dpjax.pretrained.hf` reports both before reading anything).
  Raises ValueError for pooling="mean" without `encoder_only` (a HF
  classification head reads the BertPooler output).
  """
  if config.pooling != "cls" and not encoder_only:
    raise ValueError("A BertForSequenceClassification head reads the BertPooler output; "
                     f"with pooling={config.pooling!r} load with encoder_only=True.")
  keys = set(reader.keys())
  prefix = _PREFIX if any(k.startswith(_PREFIX) for k in keys) else ""

  def resolve(entry: _Entry) -> str:
    """The checkpoint's name for an entry: canonical, else legacy, else canonical."""
    name = (prefix if entry.in_bert else "") + entry.name
    for new, old in _LEGACY.items():
      if name not in keys and name.endswith(new) and name[:-len(new)] + old in keys:
        return name[:-len(new)] + old
    return name

  transpose = lambda x: np.ascontiguousarray(x.T)
  sources: dict = {}
  for entry in _table(config, encoder_only):
    _set(sources, entry.path, hf_common.tensor(reader, resolve(entry),
                                               transpose if entry.transpose else None))

  ignorable = {k for k in keys if k[len(prefix):] in _BUFFERS}
  if encoder_only:
    # Task heads: everything outside 'bert.' (if the names have it at all).
    ignorable |= {k for k in keys if (prefix and not k.startswith(prefix))
                  or k.startswith(("classifier.", "cls."))}
    if config.pooling != "cls":
      ignorable |= {k for k in keys if k.startswith(prefix + "pooler.")}
  return sources, ignorable


# ----------------------------------------------------------------------------
# Export.
# ----------------------------------------------------------------------------


def to_hf_state_dict(config: BertConfig, params: PyTree) -> dict[str, np.ndarray]:
  """dpjax params -> a Hugging Face state dict (float32 numpy, `[out, in]` weights).

  Full `BertClassifier` params give `BertForSequenceClassification` names
  ('bert.…', 'classifier.…'), loadable with `load_state_dict(strict=True)`;
  encoder-only params (`{'encoder', 'pooler'}`, no 'classifier') give plain
  `BertModel` names. The exact inverse of `param_sources`. Needs
  pooling="cls".
  """
  _check_exportable(config)
  encoder_only = "classifier" not in params
  prefix = "" if encoder_only else _PREFIX
  out = {}
  for entry in _table(config, encoder_only):
    x = np.asarray(_get(params, entry.path), np.float32)
    if x.shape != entry.shape:
      raise ValueError(f"params{list(entry.path)} has shape {x.shape}, expected {entry.shape}")
    # Own, writable, C-contiguous copies (torch.from_numpy wants writable).
    out[(prefix if entry.in_bert else "") + entry.name] = np.array(
        x.T if entry.transpose else x, np.float32, order="C")
  return out
