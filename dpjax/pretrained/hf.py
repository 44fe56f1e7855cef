"""Hugging Face checkpoint directories <-> dpjax params.

A checkpoint directory holds `config.json` and the weights as
`model.safetensors`, sharded `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`, or PyTorch's `pytorch_model.bin` (or its
sharded `.bin` + index form). Safetensors are preferred when both exist. The
per-model name mapping lives in `dpjax.models.hf_<model>` (picked by the
config's type); this module reads, checks and places tensors.

`load_hf` checks everything it can before reading a single tensor: the
config.json architecture against the gin config, then every parameter's
source tensors (present? shape, through the mapping's own transform, equal to
the model's?), then that no checkpoint tensor is left unused (aliases such as
tied embeddings aside). Any problem raises `CheckpointError`, which names the
field or tensor and both values or shapes; nothing half-loaded is returned.

Vocabulary growth (GPT-2; a mapping opts in with `VOCAB_PARAMS`): a gin
`vocab_size` larger than config.json's is not a mismatch but tokens appended
to the checkpoint's tokenizer (e.g. the label or control tokens of a task),
as with Hugging Face's `resize_token_embeddings`. Rows `0..V_ckpt-1` of those
params are the checkpoint's, the new rows drawn from the Gaussian of their
mean and covariance (`grow_rows` says why), and one line reports how many
rows were added. Every check above then runs against the checkpoint's
vocabulary. A smaller gin `vocab_size` is an error: it would drop pretrained
rows.

Host memory: tensors are read one at a time, each straight from its file
and upcast to float32 (`tensor_files` says how), transformed (transposes and
slices are views), put on its device(s) with its sharding, waited for, and
dropped before the next is read. Peak host memory is about one float32
tensor (the largest is the embedding, e.g. 128 MB for a 3B T5; two while a
vocabulary grows, the checkpoint's and the grown copy), never the model. On a
CPU backend the device arrays themselves live in host memory: jax may adopt
the loaded buffer as the array, so nothing is copied twice.

Export (`export_hf`) writes `config.json` and one `model.safetensors`,
streaming one tensor at a time into the file
(`tensor_files.write_safetensors`).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import pathlib
import sys
from typing import Any, Mapping

import jax
import numpy as np

from dpjax import fileio
from dpjax.training import reporting
from dpjax.models import hf_common, lora, t5
from dpjax.pretrained import tensor_files
from dpjax.pretrained.tensor_files import (  # noqa: F401  DictReader: importable from here
    CheckpointError, DictReader, SafetensorsReader, TorchReader)

PyTree = Any

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = tensor_files.SAFETENSORS_FILE
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

# (config module, config class, mapping module). Imported only when a config
# of that class is seen, so a mapping may land later (bert).
_MODELS = (
    ("dpjax.models.t5", "T5Config", "dpjax.models.hf_t5"),
    ("dpjax.models.gpt2", "GPT2Config", "dpjax.models.hf_gpt2"),
    ("dpjax.models.bert", "BertConfig", "dpjax.models.hf_bert"),
)
# Config fields that are training choices, not architecture: config.json may
# disagree with the gin config on them. A mapping may set NON_ARCH_FIELDS.
_NON_ARCH_FIELDS = ("dropout_rate", "dtype", "remat")
_MAX_LISTED = 20
_GROW_STREAM = 0x67726F77  # "grow": the new embedding rows' stream


def _listing(problems: list[str]) -> str:
  shown = problems[:_MAX_LISTED]
  more = len(problems) - len(shown)
  return "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")


# ----------------------------------------------------------------------------
# Opening a checkpoint directory.
# ----------------------------------------------------------------------------


class _ShapeReader:
  """Answers `get` with a zero-strided float32 array of the tensor's shape.

  Running a mapping's transforms on these computes every parameter's shape
  exactly as loading would, without reading or allocating anything.
  """

  def __init__(self, reader: hf_common.TensorReader):
    self._reader = reader

  def keys(self):
    return self._reader.keys()

  def shape(self, name):
    return self._reader.shape(name)

  def get(self, name):
    return np.broadcast_to(np.zeros((), np.float32), self._reader.shape(name))


def _index_files(directory: pathlib.Path, index: str) -> list[pathlib.Path]:
  weight_map = json.loads((directory / index).read_text())["weight_map"]
  return [directory / f for f in sorted(set(weight_map.values()))]


def open_hf_checkpoint(path: str | os.PathLike) -> tuple[dict, hf_common.TensorReader]:
  """`(config.json as a dict, a reader of the weights)` of a checkpoint directory."""
  directory = pathlib.Path(path)
  config_file = directory / CONFIG_FILE
  if not config_file.is_file():
    raise CheckpointError(f"{directory} has no {CONFIG_FILE}: not a Hugging Face checkpoint")
  try:
    hf_config = json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e
  files = weight_files(directory)
  weights = [f for f in files if f.name not in (SAFETENSORS_INDEX, TORCH_INDEX)]
  reader = (SafetensorsReader if weights[0].suffix == ".safetensors" else TorchReader)(weights)
  return hf_config, reader


def weight_files(path: str | os.PathLike) -> list[pathlib.Path]:
  """The files `open_hf_checkpoint` reads the weights from (safetensors
  first): one file, or an index and its shards."""
  directory = pathlib.Path(path)
  for single, index in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (TORCH_FILE, TORCH_INDEX)):
    if (directory / single).is_file():
      return [directory / single]
    if (directory / index).is_file():
      return [directory / index, *_index_files(directory, index)]
  raise CheckpointError(
      f"{directory} has {CONFIG_FILE} but no weights: expected {SAFETENSORS_FILE}, "
      f"{SAFETENSORS_INDEX}, {TORCH_FILE} or {TORCH_INDEX}")


def tokenizer_files(path: str | os.PathLike) -> dict[str, str]:
  """The tokenizer files a checkpoint directory carries, by kind.

  {'sentencepiece': .../spiece.model} (T5), {'vocab': .../vocab.json,
  'merges': .../merges.txt} (GPT-2 BPE), {'wordpiece': .../vocab.txt} (BERT),
  or {} when there are none.
  """
  d = pathlib.Path(path)
  if (d / "spiece.model").is_file():
    return {"sentencepiece": str(d / "spiece.model")}
  if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
    return {"vocab": str(d / "vocab.json"), "merges": str(d / "merges.txt")}
  if (d / "vocab.txt").is_file():
    return {"wordpiece": str(d / "vocab.txt")}
  return {}


# ----------------------------------------------------------------------------
# Model dispatch and checks.
# ----------------------------------------------------------------------------


def mapping_for(config):
  """The `dpjax.models.hf_*` module for a model config."""
  cls = type(config)
  for module, name, mapping in _MODELS:
    if cls.__module__ == module and cls.__name__ == name:
      return importlib.import_module(mapping)
  raise CheckpointError(f"No Hugging Face mapping for {cls.__module__}.{cls.__name__}")


def _abstract_target(config, mapping) -> PyTree:
  """ShapeDtypeStruct params of the model (lengths 1: shapes do not depend on them)."""
  if hasattr(mapping, "abstract_target"):
    return mapping.abstract_target(config)
  abstract_params = sys.modules[type(config).__module__].abstract_params
  lengths = {name: 1 for name, p in inspect.signature(abstract_params).parameters.items()
             if p.kind == p.KEYWORD_ONLY and p.default is p.empty}
  return abstract_params(config, **lengths)[0]


def _architecture(config, mapping, ignore=()) -> dict:
  # LoRA adapters sit on top of a checkpoint's model, never in it (and gin
  # may put a bound LoRAConfig into the config built from config.json).
  skip = (set(getattr(mapping, "NON_ARCH_FIELDS", _NON_ARCH_FIELDS))
          | set(ignore) | {"lora"})
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in skip}
  if "d_ff" in fields and hasattr(config, "mlp_dim"):
    fields["d_ff"] = config.mlp_dim  # None means the default width (GPT-2: 4 * d_model)
  return fields


def check_config(hf_config: Mapping[str, Any], config, mapping=None,
                 ignore: tuple[str, ...] = ()):
  """The checkpoint's model config; raises CheckpointError unless config.json
  describes the gin model (fields in `ignore` may differ, and a larger gin
  `vocab_size` where the mapping has `VOCAB_PARAMS`: those grow)."""
  mapping = mapping or mapping_for(config)
  model_type = hf_config.get("model_type")
  if model_type not in mapping.HF_MODEL_TYPES:
    raise CheckpointError(
        f"config.json model_type is {model_type!r}, but the gin model "
        f"{type(config).__name__} reads {mapping.HF_MODEL_TYPES}")
  try:
    theirs = mapping.config_from_hf(hf_config)
  except KeyError as e:
    raise CheckpointError(f"config.json has no {e}") from e
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"config.json: {e}") from e
  names = getattr(mapping, "HF_FIELD_NAMES", {})
  grows = bool(getattr(mapping, "VOCAB_PARAMS", ()))
  a = _architecture(theirs, mapping, ignore)
  b = _architecture(config, mapping, ignore)
  diffs = []
  for k in b:
    if a.get(k) == b[k] or (grows and k == "vocab_size" and a[k] < b[k]):
      continue
    diff = (f"{k}{f' (config.json {names[k]!r})' if k in names else ''}: "
            f"checkpoint {a.get(k)!r}, gin {b[k]!r}")
    if grows and k == "vocab_size":
      diff += (f" (a smaller gin vocabulary would drop the pretrained embedding rows "
               f"{b[k]}..{a[k] - 1}; only growing it is supported)")
    diffs.append(diff)
  if diffs:
    raise CheckpointError("config.json disagrees with the gin model config:" + _listing(diffs))
  return theirs


def _keystr(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _flat_shardings(shardings, treedef, n: int) -> list:
  if shardings is None:
    return [None] * n
  if isinstance(shardings, jax.sharding.Sharding):
    return [shardings] * n
  leaves, tree = jax.tree.flatten(
      shardings, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))
  if tree != treedef:
    raise ValueError(f"shardings do not match the params tree: {tree} vs {treedef}")
  return leaves


def grow_rows(table: np.ndarray, rows: int) -> np.ndarray:
  """`table` `[V, d]` followed by `rows - V` new rows, each drawn from
  N(μ, Σ), the mean and covariance of the table's rows.

  Why (Hewitt 2021, "Initializing new word embeddings for pretrained
  language models"; Hugging Face's `resize_token_embeddings(mean_resizing=
  True)` names the same Gaussian): under the tied LM head a new token's
  logit `h . x` is then Gaussian with the mean and variance of the
  pretrained tokens' logits at that position, so it starts as likely as a
  typical pretrained token instead of dominating the softmax (as a row of
  another scale could), and the pretrained tokens keep their logits. Copies
  of the mean would satisfy that too, but the new tokens would be one token
  to the model: label or control tokens must differ from the first step (on
  the textcls sample, mean-initialised label rows were still 10x closer than
  two words after 125 steps at ε = ∞, and the LM ignored the label;
  docs/benchmarks.md).

  Drawn as μ + (E - μ)ᵀ g / √V with g ~ N(0, I_V), whose covariance is Σ
  exactly (no factorisation; a singular Σ is fine), from a fixed stream
  seeded by (V, rows): the import is a function of the checkpoint alone,
  reproducible and keyless. Host cost: a `[rows - V, V]` draw and its product
  with the table; no centred or float64 copy of the table, so the import's
  peak stays the table and its grown copy.
  """
  v = len(table)
  grown = np.empty((rows, *table.shape[1:]), table.dtype)
  grown[:v] = table
  mean = table.mean(axis=0, dtype=np.float64)
  g = np.random.default_rng([_GROW_STREAM, v, rows]).standard_normal((rows - v, v))
  # (E - μ)ᵀ g = Eᵀ g - μ Σg; g in the table's float32 for the product, so
  # numpy makes no float64 copy of the table.
  centred = g.astype(table.dtype) @ table - np.outer(g.sum(axis=1), mean)
  grown[v:] = mean + centred / np.sqrt(v)
  return grown


def _put(x: np.ndarray, sharding) -> jax.Array:
  """One host array onto its device(s); waits, so the host copy can go."""
  out = jax.device_put(x) if sharding is None else jax.make_array_from_callback(
      x.shape, sharding, lambda index: x[index])
  return out.block_until_ready()


# ----------------------------------------------------------------------------
# Import and export.
# ----------------------------------------------------------------------------


def load_from_reader(hf_config: Mapping[str, Any], reader: hf_common.TensorReader, config,
                     *, shardings=None, encoder_only: bool = False) -> PyTree:
  """`load_hf` on an opened checkpoint (`open_hf_checkpoint`, or a DictReader)."""
  mapping = mapping_for(config)
  options = {"encoder_only": True} if encoder_only else {}
  theirs = check_config(hf_config, config, mapping,
                        ignore=("num_labels",) if encoder_only else ())
  target = _abstract_target(config, mapping)
  # Read and checked at the checkpoint's vocabulary; VOCAB_PARAMS grow after.
  vocab_params = getattr(mapping, "VOCAB_PARAMS", ())
  new_rows = config.vocab_size - theirs.vocab_size if vocab_params else 0
  ckpt_config = dataclasses.replace(config, vocab_size=theirs.vocab_size) if new_rows else config
  grown = {"/".join(p) for p in vocab_params} if new_rows else set()
  abstract = _abstract_target(ckpt_config, mapping)
  is_source = lambda x: isinstance(x, hf_common.Source)
  try:
    sources, aliases = mapping.param_sources(ckpt_config, reader, **options)
    dry_sources, _ = mapping.param_sources(ckpt_config, _ShapeReader(reader),
                                           **options)
  except (ValueError, TypeError) as e:  # an option this model has no use for
    raise CheckpointError(str(e)) from e
  if encoder_only:  # only the encoder's subtrees; the caller initialises the rest
    abstract = {k: abstract[k] for k in sources}
    target = {k: target[k] for k in sources}
    if isinstance(shardings, Mapping):
      shardings = {k: shardings[k] for k in sources}
  abstract_leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  source_leaves, source_tree = jax.tree.flatten(sources, is_leaf=is_source)
  dry_leaves = jax.tree.leaves(dry_sources, is_leaf=is_source)
  if source_tree != treedef:
    raise CheckpointError(  # a mapping bug, not a checkpoint problem
        f"{mapping.__name__}.param_sources does not match the params of {config}: "
        f"{source_tree} vs {treedef}")

  # Every check that needs shapes only, before any tensor is read.
  keys = set(reader.keys())
  used: set[str] = set()
  problems = []
  for (path, leaf), dry in zip(abstract_leaves, dry_leaves):
    param, want = _keystr(path), tuple(leaf.shape)
    used.update(dry.names)
    missing = [n for n in dry.names if n not in keys]
    if missing:
      problems += [f"missing tensor {n!r}, needed for param {param} (shape {want})"
                   for n in missing]
      continue
    described = ", ".join(f"tensor {n!r} of shape {reader.shape(n)}" for n in dry.names)
    try:
      shape = tuple(dry.load().shape)
    except Exception as e:  # a transform that cannot apply to this shape
      problems.append(f"{described} does not fit param {param} (shape {want}): {e}")
      continue
    if shape != want:
      problems.append(f"{described} gives {shape}, but param {param} has shape {want}")
  unused = sorted(keys - used - set(aliases))
  problems += [f"unused tensor {n!r} of shape {reader.shape(n)} (no parameter reads it)"
               for n in unused]
  if problems:
    raise CheckpointError(f"Checkpoint does not fit {type(config).__name__}:"
                          + _listing(problems))

  shards = _flat_shardings(shardings, treedef, len(source_leaves))
  arrays = []
  for (path, leaf), want, source, sharding in zip(abstract_leaves, jax.tree.leaves(target),
                                                  source_leaves, shards):
    try:
      x = source.load()
    except Exception as e:
      raise CheckpointError(f"reading {source.names} for {_keystr(path)} failed: {e}") from e
    if x.shape != tuple(leaf.shape):  # checked above; a reader that lied about shapes
      raise CheckpointError(f"{source.names} gave shape {x.shape} for {_keystr(path)}: "
                            f"expected {tuple(leaf.shape)}")
    if _keystr(path) in grown:
      x = grow_rows(x, want.shape[0])
    arrays.append(_put(x.astype(want.dtype, copy=False), sharding))
    del x  # the only host copy; the next tensor is read after it is gone
  if new_rows:
    reporting.say(f"vocabulary grown from the checkpoint's {theirs.vocab_size} to "
                  f"{config.vocab_size} tokens: {new_rows} embedding rows added, drawn "
                  "from the Gaussian of the pretrained rows' mean and covariance")
  return jax.tree.unflatten(treedef, arrays)


def load_hf(path: str | os.PathLike, config, *, shardings=None,
            encoder_only: bool = False) -> PyTree:
  """Params of `config`'s model from a Hugging Face checkpoint directory.

  `shardings`: None (default device), one `jax.sharding.Sharding` for every
  param, or a params-shaped tree of them (e.g.
  `partitioning.param_shardings(mesh, logical_axes)`). Raises CheckpointError
  (naming the field or tensor and both values or shapes) if config.json
  disagrees with `config` on the architecture (dropout may differ), or a
  tensor is missing, mis-shaped or unused; nothing is read before all of
  that is checked. A GPT-2 whose gin `vocab_size` exceeds the checkpoint's
  gets the extra embedding rows (module docstring); a smaller one is an
  error. `encoder_only` (BERT): load only the encoder and pooler
  from a plain `BertModel` checkpoint (e.g. bert-base-uncased), returning
  those subtrees for the caller to merge over a freshly initialised head.
  """
  hf_config, reader = open_hf_checkpoint(path)
  return load_from_reader(hf_config, reader, config, shardings=shardings,
                          encoder_only=encoder_only)


def export_hf(params: PyTree, config, out_dir: str | os.PathLike) -> None:
  """Writes `config.json` and `model.safetensors` that transformers loads
  (`AutoModel...from_pretrained(out_dir)`) and `load_hf` reads back exactly.
  A model with LoRA adapters is written merged (`lora.merged`): the base
  model's layout, computing what the adapted model computes; a T5 with
  scanned layers, unrolled (`t5.unrolled`)."""
  params, config = t5.unrolled(params, config)
  if getattr(config, "lora", None) is not None:
    params = lora.merged(params, config.lora)
    config = dataclasses.replace(config, lora=None)
  mapping = mapping_for(config)
  abstract = _abstract_target(config, mapping)
  want = {_keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
  have = {_keystr(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(params)}
  problems = [f"param {k}: shape {have.get(k)}, expected {v}" for k, v in want.items()
              if have.get(k) != v] + [f"param {k} is not in the model" for k in have
                                      if k not in want]
  if problems:
    raise CheckpointError(f"params do not fit {type(config).__name__}:" + _listing(problems))
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tensor_files.write_safetensors(out / SAFETENSORS_FILE, mapping.to_hf_state_dict(config, params))
  fileio.write_atomic(out / CONFIG_FILE, json.dumps(mapping.config_to_hf(config), indent=2,
                                                    sort_keys=True) + "\n")
