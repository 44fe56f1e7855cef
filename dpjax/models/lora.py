"""LoRA adapters (Hu et al., 2021) on the dense projections of T5 and GPT-2,
for DP fine-tuning of the adapters alone (Yu et al., ICLR 2022).

A targeted projection `y = x W` becomes `y = x W + (alpha / rank) *
dropout(x) A B`: `W` [rows, cols] keeps its place and name in the params
(`.../query/kernel`), so a pretrained checkpoint loads unchanged, and the
adapter is a sibling module `.../query_lora` with `a/kernel` [rows, rank]
(normal, stddev 1/sqrt(rows)) and `b/kernel` [rank, cols] (zeros: the
adapted model starts as the base model). Both factors are
`privacy.layers.Dense` calls, so ghost clipping sees each as a site and
takes its per-example norm from the same Gram identity as a full weight's;
the scale is applied to the call's output, outside the site.

`trainable_mask` says which leaves train: the adapters ('lora_only'), or
the adapters plus every norm scale and bias ('lora_norms_biases'). The
frozen leaves get no gradient, no clipping share and no noise (the
trainer's mask), so the release covers only the trained coordinates.

In gin:

    T5Config.lora = @LoRAConfig()
    LoRAConfig.rank = 8
    LoRAConfig.targets = ('q', 'k', 'v', 'o')   # and/or 'mlp'
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpjax.privacy import layers

TARGETS = ("q", "k", "v", "o", "mlp")
TRAIN = ("lora_only", "lora_norms_biases")
# The models' projection names, by target.
_NAMES = {"query": "q", "key": "k", "value": "v", "out": "o", "wi": "mlp",
          "wi_0": "mlp", "wi_1": "mlp", "wo": "mlp"}
SUFFIX = "_lora"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Which projections get adapters, and their shape."""
  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0  # on the adapter's input, in training only
  targets: tuple[str, ...] = ("q", "k", "v", "o")
  train: str = "lora_only"

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if self.rank < 1:
      raise ValueError(f"LoRAConfig.rank must be >= 1, got {self.rank}")
    if not set(self.targets) <= set(TARGETS) or not self.targets:
      raise ValueError(f"LoRAConfig.targets must be some of {TARGETS}, got "
                       f"{self.targets}")
    if self.train not in TRAIN:
      raise ValueError(f"LoRAConfig.train must be one of {TRAIN}, got "
                       f"{self.train!r}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got "
                       f"{self.dropout}")

  @property
  def scale(self) -> float:
    """The adapters' output scale: `alpha / rank`."""
    return self.alpha / self.rank


class Adapter(nn.Module):
  """`scale * dropout(x) @ a @ b`, both factors `layers.Dense` sites."""
  config: LoRAConfig
  features: int
  kernel_axes: tuple[str, str]
  dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    cfg = self.config
    x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
    h = layers.Dense(cfg.rank, (self.kernel_axes[0], "lora_rank"),
                     x.shape[-1] ** -0.5, self.dtype, name="a")(x)
    y = layers.Dense(self.features, ("lora_rank", self.kernel_axes[1]), 0.0,
                     self.dtype, name="b")(h)
    return y * jnp.asarray(cfg.scale, y.dtype)


def dense(lora: LoRAConfig | None, x: jax.Array, features: int,
          kernel_axes: tuple[str, str], stddev: float, dtype, *, name: str,
          deterministic: bool = True, use_bias: bool = False) -> jax.Array:
  """The projection `name` of `x` (a `layers.Dense`), plus its adapter
  (`name + '_lora'`) where `lora` targets it. Call inside a compact method."""
  y = layers.Dense(features, kernel_axes, stddev, dtype, use_bias=use_bias,
                   name=name)(x)
  if lora is None or _NAMES.get(name) not in lora.targets:
    return y
  return y + Adapter(lora, features, kernel_axes, dtype,
                     name=name + SUFFIX)(x, deterministic)


def trainable_mask(lora: LoRAConfig, params) -> Any:
  """Bools shaped like `params` (or their shapes): the leaves that train."""
  def trains(path, _):
    names = [getattr(k, "key", str(k)) for k in path]
    if any(str(n).endswith(SUFFIX) for n in names):
      return True
    return lora.train == "lora_norms_biases" and names[-1] in ("scale",
                                                               "bias")
  return jax.tree_util.tree_map_with_path(trains, params)


def split(tree) -> tuple[Any, Any]:
  """(the base model's subtree, the adapters' subtree) of a params-shaped
  nested dict (params, shapes or shardings); `merge` inverts it."""
  if not isinstance(tree, Mapping):
    return tree, None
  base, adapters = {}, {}
  for key, value in tree.items():
    if key.endswith(SUFFIX):
      adapters[key] = value
      continue
    b, a = split(value)
    base[key] = b
    if a:
      adapters[key] = a
  return base, adapters


def merge(base, adapters):
  """The params of the adapted model from `split`'s two parts."""
  if not adapters:
    return base
  return {**{k: merge(v, adapters.get(k)) for k, v in base.items()},
          **{k: v for k, v in adapters.items() if k.endswith(SUFFIX)}}


def merged(params, lora: LoRAConfig):
  """The base model's params with every adapter folded into its projection,
  `W + scale * A B` (the bias untouched): the adapted model's function in
  the base model's layout (what a Hugging Face export writes)."""
  base, adapters = split(params)

  def fold(base_tree, adapter_tree):
    out = dict(base_tree)
    for key, value in adapter_tree.items():
      if key.endswith(SUFFIX):
        name = key[:-len(SUFFIX)]
        delta = lora.scale * (jnp.asarray(value["a"]["kernel"], jnp.float32)
                              @ jnp.asarray(value["b"]["kernel"], jnp.float32))
        out[name] = {**out[name], "kernel": out[name]["kernel"] + delta}
      else:
        out[key] = fold(base_tree[key], value)
    return out

  return fold(base, adapters)
