"""LoRA adapters alone, in PEFT's file layout (and back).

A PEFT LoRA directory holds `adapter_config.json` and
`adapter_model.safetensors`, whose tensors are named after the Hugging Face
module they adapt: `base_model.model.<module>.lora_A.weight` `[r, in]` and
`...lora_B.weight` `[out, r]`, the module computing `W x + (lora_alpha / r)
B A x`. Ours are `a/kernel` `[in, r]` and `b/kernel` `[r, out]` beside the
projection (`dpjax.models.lora`), so A = aᵀ and B = bᵀ.

Where HF fuses projections that dpjax keeps apart (GPT-2's `c_attn` holds
query, key and value), the adapters of the fused module are one adapter of
rank k·r: A stacks the k `a`s, B places each `b` on its projection's output
columns (zeros elsewhere), and `rank_pattern` / `alpha_pattern` give that
module rank k·r and alpha k·α, so its scale α/r is unchanged and its update
is exactly the sum of ours. Which modules a mapping adapts, and where each
projection's columns start, is its `lora_modules(config)`.

Only adapters are written: a run that also trained norms and biases
(`LoRAConfig.train = 'lora_norms_biases'`) changed more than PEFT's LoRA
file holds, and is refused (export it merged). `load_adapters` reads such a
directory back into dpjax adapters (it refuses a fused module whose B is
not block-diagonal: that is not separate adapters); with the base model
from `adapter_config.json`'s `base_model_name_or_path`,
`dpjax.pretrained.load_pretrained` rebuilds the adapted model.

The base model is named portably (`describe_base`): `base_model_name_or_path`
is the Hugging Face hub name the base's config.json carries
(`_name_or_path`, when that is a hub id and not a local path), else the base
directory's name, or what the caller gives; never a local path.
`BASE_MODEL_FILE` beside the adapters records that name, the sha256 of each
of the base's weight files (so a user can check they loaded the right base;
`check_base` refuses another) and both vocabulary sizes.

A grown vocabulary (a GPT-2 whose gin vocab_size exceeds the base's: the
rows `hf.grow_rows` appended) is carried as PEFT carries resized embeddings
(`save_embedding_layers`): the whole table under the HF names of the token
embedding and its tied LM head (`transformer.wte.weight`,
`lm_head.weight`), which PEFT's loader puts into a base whose embeddings
were first resized to the grown size (`base.resize_token_embeddings(V)`,
then `PeftModel.from_pretrained(base, release)`); `load_embeddings` reads
it back.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from typing import Any

import numpy as np

from dpjax import fileio
from dpjax.models import lora, t5, trainable
from dpjax.pretrained import hf, tensor_files
from dpjax.pretrained.tensor_files import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_MODEL_FILE = "base_model.json"
_PREFIX = "base_model.model."
# A mapping's params whose rows grow with the vocabulary (`VOCAB_PARAMS`) ->
# the HF tensors PEFT saves for a resized embedding (a tied head included).
_EMBEDDINGS = {
    "dpjax.models.hf_gpt2": {("token_embedder", "embedding"):
                             ("transformer.wte.weight", "lm_head.weight")},
}
# A Hugging Face hub id: `name` or `owner/name`, no path syntax.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
_HASH_CHUNK = 1 << 24


def is_adapter_dir(path) -> bool:
  """Whether `path` is a PEFT adapter directory (has `ADAPTER_CONFIG`)."""
  return (pathlib.Path(path) / ADAPTER_CONFIG).is_file()


def _node(tree, path):
  for key in path:
    if not isinstance(tree, dict) or key not in tree:
      return None
    tree = tree[key]
  return tree


def _modules(config):
  mapping = hf.mapping_for(config)
  if not hasattr(mapping, "lora_modules"):
    raise CheckpointError(f"{type(config).__name__} has no PEFT layout")
  return mapping, list(mapping.lora_modules(config))


def _sibling(projection: tuple) -> tuple:
  return (*projection[:-1], projection[-1] + lora.SUFFIX)


def is_local_path(name: str) -> bool:
  """Whether `name` reads as a path on some machine, not a hub id."""
  return (os.path.isabs(name) or name.startswith(("~", ".")) or "\\" in name
          or not _HUB_ID.fullmatch(name))


def weights_sha256(base_path) -> dict[str, str]:
  """{file name: sha256 hex} of the weight files `hf.open_hf_checkpoint`
  reads from the Hugging Face directory `base_path` (its index too)."""
  directory = pathlib.Path(base_path)
  files = hf.weight_files(directory)
  out = {}
  for f in files:
    digest = hashlib.sha256()
    with open(f, "rb") as stream:
      while chunk := stream.read(_HASH_CHUNK):
        digest.update(chunk)
    out[f.name] = digest.hexdigest()
  return out


def describe_base(base_path, name: str | None = None) -> dict:
  """The `BASE_MODEL_FILE` record of the base checkpoint `base_path` (a
  Hugging Face directory): its portable name (`name`, else config.json's hub
  `_name_or_path`, else the directory's name), weight files' sha256 and
  vocabulary size."""
  directory = pathlib.Path(base_path)
  if not (directory / hf.CONFIG_FILE).is_file():
    raise CheckpointError(
        f"the base checkpoint {base_path} is not a Hugging Face directory "
        f"({hf.CONFIG_FILE}), which PEFT's adapters need: export the merged "
        "model")
  hf_config = hf.open_hf_checkpoint(directory)[0]
  if name is not None and is_local_path(name):
    raise CheckpointError(f"base model name {name!r} is a local path; name "
                          "the base portably (a hub id or a plain name)")
  hub = hf_config.get("_name_or_path")
  if name is None:
    name = (hub if isinstance(hub, str) and hub and not is_local_path(hub)
            else directory.resolve().name)
  return {"base_model_name_or_path": name,
          "weights_sha256": weights_sha256(directory),
          "base_vocab_size": hf_config.get("vocab_size")}


def read_base_record(path) -> dict:
  """`path`'s `BASE_MODEL_FILE` as a dict ({} if it has none)."""
  file = pathlib.Path(path) / BASE_MODEL_FILE
  if not file.is_file():
    return {}
  try:
    return json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{file}: {e}") from None


def check_base(path, base_path) -> None:
  """CheckpointError unless `base_path`'s weights are the ones `path`'s
  `BASE_MODEL_FILE` records (nothing to check without one)."""
  want = read_base_record(path).get("weights_sha256")
  if not want:
    return
  try:
    got = weights_sha256(base_path)
  except (OSError, CheckpointError) as e:
    raise CheckpointError(f"{path}: its base {base_path} cannot be "
                          f"fingerprinted: {e}") from None
  if got != want:
    raise CheckpointError(
        f"{path}: the base {base_path} is not the base these adapters were "
        f"trained on (weights sha256 {_short(got)}, expected {_short(want)})")


def _short(digests: dict) -> str:
  return ", ".join(f"{k} {v}" for k, v in sorted(digests.items()))


def carried_embeddings(config, base: dict | None) -> dict:
  """{param path: (HF names)} of the vocabulary params to carry: those of a
  model whose vocab_size exceeds the base's."""
  mapping = hf.mapping_for(config)
  vocab_params = getattr(mapping, "VOCAB_PARAMS", ())
  base_vocab = (base or {}).get("base_vocab_size")
  if not vocab_params or base_vocab is None or config.vocab_size == base_vocab:
    return {}
  if config.vocab_size < base_vocab:
    raise CheckpointError(f"vocab_size {config.vocab_size} is smaller than the "
                          f"base's {base_vocab}")
  names = _EMBEDDINGS.get(mapping.__name__)
  if names is None:
    raise CheckpointError(
        f"the vocabulary grew from the base's {base_vocab} to "
        f"{config.vocab_size} tokens and {mapping.__name__} has no PEFT names "
        "for its embeddings: export the merged model")
  return {p: names[p] for p in vocab_params}


def export_adapters(params, config, out_dir, *, base_model: str | None = None,
                    base: dict | None = None) -> list[str]:
  """Writes the adapters of `params` (a model with `config.lora`) as a PEFT
  LoRA directory. `base` (`describe_base` of the base checkpoint): its name
  goes to `base_model_name_or_path` and the record to `BASE_MODEL_FILE`, and
  a vocabulary grown past the base's is carried; without it, `base_model` (a
  portable name, never a local path) is the name. Returns the files
  written."""
  params, config = t5.unrolled(params, config)
  cfg = getattr(config, "lora", None)
  if cfg is None:
    raise CheckpointError("the model has no LoRA adapters to export alone")
  if cfg.train != "lora_only":
    raise CheckpointError(
        f"LoRAConfig.train = {cfg.train!r} also trained the norms and biases, "
        "which PEFT's LoRA file does not hold: export the merged model")
  if base is not None:
    base_model = base["base_model_name_or_path"]
  elif base_model is not None and is_local_path(base_model):
    raise CheckpointError(f"base model name {base_model!r} is a local path; "
                          "name the base portably (a hub id or a plain name)")
  grown = carried_embeddings(config, base)
  mapping, modules = _modules(config)
  tensors, targets, ranks, alphas = {}, [], {}, {}
  for module, projections in modules:
    found = [(p, col, _node(params, _sibling(p))) for p, col in projections]
    found = [(p, col, adapter) for p, col, adapter in found if adapter]
    if not found:
      continue
    a = np.concatenate([np.asarray(ad["a"]["kernel"], np.float32)
                        for _, _, ad in found], axis=1)  # [in, k r]
    out = sum(np.shape(_node(params, p)["kernel"])[-1]
              for p, _ in projections)
    b = np.zeros((a.shape[1], out), np.float32)  # [k r, out]
    for j, (p, col, ad) in enumerate(found):
      block = np.asarray(ad["b"]["kernel"], np.float32)
      b[j * cfg.rank:(j + 1) * cfg.rank, col:col + block.shape[1]] = block
    tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
    tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
    targets.append(module)
    if len(found) > 1:
      ranks[module], alphas[module] = len(found) * cfg.rank, len(found) * cfg.alpha
  for path, names in grown.items():
    table = np.ascontiguousarray(np.asarray(_node(params, path), np.float32))
    for name in names:
      tensors[f"{_PREFIX}{name}"] = table
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  tensor_files.write_safetensors(out_dir / ADAPTER_WEIGHTS, tensors)
  adapter_config = {
      "peft_type": "LORA", "task_type": mapping.PEFT_TASK_TYPE,
      "base_model_name_or_path": base_model, "r": cfg.rank,
      "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
      "target_modules": targets, "rank_pattern": ranks,
      "alpha_pattern": alphas, "fan_in_fan_out": mapping.PEFT_FAN_IN_FAN_OUT,
      "bias": "none", "modules_to_save": None, "inference_mode": True,
      "init_lora_weights": True, "use_rslora": False, "use_dora": False,
      "layers_to_transform": None, "layers_pattern": None, "revision": None,
  }
  fileio.write_atomic(out_dir / ADAPTER_CONFIG,
                      json.dumps(adapter_config, indent=2) + "\n")
  if base is None:
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
  record = {**base, "vocab_size": config.vocab_size,
            "embeddings_carried": sorted(n for names in grown.values()
                                         for n in names)}
  if grown:
    record["note"] = (
        f"the vocabulary grew from {base['base_vocab_size']} to "
        f"{config.vocab_size} tokens: resize the base's embeddings first "
        f"(base.resize_token_embeddings({config.vocab_size})), then "
        "PeftModel.from_pretrained(base, this directory) loads the whole "
        "grown table")
  fileio.write_atomic(out_dir / BASE_MODEL_FILE,
                      json.dumps(record, indent=2, sort_keys=True) + "\n")
  return [ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_MODEL_FILE]


def read_adapter_config(path) -> dict:
  """The JSON of `path`'s `ADAPTER_CONFIG`; CheckpointError if unreadable."""
  try:
    return json.loads((pathlib.Path(path) / ADAPTER_CONFIG).read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path}/{ADAPTER_CONFIG}: {e}") from None


def load_adapters(path, config) -> dict:
  """The adapters subtree (`lora.split(params)[1]`) of `config`'s model from
  the PEFT directory `path`, which must match `config.lora` (rank, alpha,
  targets)."""
  cfg, peft = config.lora, read_adapter_config(path)
  if peft.get("peft_type") != "LORA":
    raise CheckpointError(f"{path}: peft_type {peft.get('peft_type')!r} is not LORA")
  if (peft.get("r"), float(peft.get("lora_alpha", 0))) != (cfg.rank, cfg.alpha):
    raise CheckpointError(
        f"{path}: r = {peft.get('r')}, lora_alpha = {peft.get('lora_alpha')}; the "
        f"gin LoRAConfig has rank {cfg.rank}, alpha {cfg.alpha}")
  reader = tensor_files.SafetensorsReader([pathlib.Path(path) / ADAPTER_WEIGHTS])
  have = set(reader.keys())
  mapping, modules = _modules(config)
  abstract = _abstract_adapters(config)
  adapters: dict = {}
  used = set()
  for module, projections in modules:
    wanted = [(p, col) for p, col in projections if _node(abstract, _sibling(p))]
    names = [f"{_PREFIX}{module}.lora_{x}.weight" for x in "AB"]
    if not wanted:
      continue
    missing = [n for n in names if n not in have]
    if missing:
      raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (LoRAConfig."
                            f"targets {cfg.targets} adapts {module})")
    used.update(names)
    a, b = reader.get(names[0]).T, reader.get(names[1]).T  # [in, k r], [k r, out]
    if a.shape[1] != len(wanted) * cfg.rank:
      raise CheckpointError(f"{path}: {names[0]} has rank {a.shape[1]}, expected "
                            f"{len(wanted) * cfg.rank} for {module}")
    expected = np.zeros_like(b)
    for j, (p, col) in enumerate(wanted):
      shape = _node(abstract, _sibling(p))["b"]["kernel"].shape
      rows = slice(j * cfg.rank, (j + 1) * cfg.rank)
      block = b[rows, col:col + shape[1]]
      expected[rows, col:col + shape[1]] = block
      node = adapters
      for key in _sibling(p)[:-1]:
        node = node.setdefault(key, {})
      node[_sibling(p)[-1]] = {"a": {"kernel": np.ascontiguousarray(a[:, rows])},
                               "b": {"kernel": np.ascontiguousarray(block)}}
    if not np.array_equal(expected, b):
      raise CheckpointError(f"{path}: {names[1]} mixes projections of {module}; "
                            "dpjax keeps one adapter per projection")
  used.update(f"{_PREFIX}{n}" for names in _EMBEDDINGS.get(mapping.__name__, {}).values()
              for n in names if f"{_PREFIX}{n}" in have)  # load_embeddings'
  unused = sorted(have - used)
  if unused:
    raise CheckpointError(f"{path}: unused tensor {unused[0]!r} (LoRAConfig.targets "
                          f"{cfg.targets}, {mapping.__name__})")
  return adapters


def load_embeddings(path, config) -> dict[tuple, np.ndarray]:
  """{param path: table} of the grown vocabulary params `path` carries ({}
  if none): each `[config.vocab_size, ...]`, its HF names (a tied head too)
  equal."""
  mapping = hf.mapping_for(config)
  reader = tensor_files.SafetensorsReader([pathlib.Path(path) / ADAPTER_WEIGHTS])
  have = set(reader.keys())
  out = {}
  for param, names in _EMBEDDINGS.get(mapping.__name__, {}).items():
    names = [f"{_PREFIX}{n}" for n in names]
    present = [n for n in names if n in have]
    if not present:
      continue
    if len(present) != len(names):
      missing = sorted(set(names) - set(present))
      raise CheckpointError(f"{path}: carries {present[0]!r} without {missing[0]!r}")
    tables = [reader.get(n) for n in names]
    if any(not np.array_equal(tables[0], t) for t in tables[1:]):
      raise CheckpointError(f"{path}: {names[0]!r} and {names[1]!r} differ; "
                            "the LM head is tied to the embedding")
    if tables[0].shape[0] != config.vocab_size:
      raise CheckpointError(f"{path}: {names[0]!r} has {tables[0].shape[0]} rows; "
                            f"the gin vocab_size is {config.vocab_size}")
    out[param] = tables[0]
  return out


def _abstract_adapters(config) -> Any:
  model = trainable.trainable(config, {"inputs": 1, "targets": 1})
  return lora.split(model.abstract_params()[0])[1]
