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
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from dpjax import fileio
from dpjax.models import lora, t5, trainable
from dpjax.pretrained import hf, tensor_files
from dpjax.pretrained.tensor_files import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


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


def export_adapters(params, config, out_dir, *,
                    base_model: str | None = None) -> list[str]:
  """Writes the adapters of `params` (a model with `config.lora`) as a PEFT
  LoRA directory; `base_model` goes to `base_model_name_or_path`. Returns
  the files written."""
  params, config = t5.unrolled(params, config)
  cfg = getattr(config, "lora", None)
  if cfg is None:
    raise CheckpointError("the model has no LoRA adapters to export alone")
  if cfg.train != "lora_only":
    raise CheckpointError(
        f"LoRAConfig.train = {cfg.train!r} also trained the norms and biases, "
        "which PEFT's LoRA file does not hold: export the merged model")
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
  return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


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
  unused = sorted(have - used)
  if unused:
    raise CheckpointError(f"{path}: unused tensor {unused[0]!r} (LoRAConfig.targets "
                          f"{cfg.targets}, {mapping.__name__})")
  return adapters


def _abstract_adapters(config) -> Any:
  model = trainable.trainable(config, {"inputs": 1, "targets": 1})
  return lora.split(model.abstract_params()[0])[1]
