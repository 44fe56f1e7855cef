"""The layers ghost clipping may intercept, and the contract it relies on.

`dpjax.privacy.ghost` computes a parameter's per-example gradient norm from
each call where the parameter meets the activations (a *site*), without the
gradient itself. That is exact only if the call computes what the Gram
identity assumes, so the models build their large matrices from these
layers, and ghost intercepts these classes and no other:

* `Dense.__call__(x)` computes exactly `x @ kernel` (+ `bias` when
  `use_bias`) on the last axis, with `kernel` its own `[rows, cols]`
  parameter, passed unchanged (cast to `dtype` only);
* `Embed.__call__(ids)` computes exactly `embedding[ids]`;
* `Embed.attend(x)` computes exactly `x @ embedding.T`, in float32.

Nothing else may happen to the parameter inside the call (no scaling,
reshaping, transposition other than `attend`'s, no second use), and the call
returns the product (plus the bias) itself: ghost takes the gradient w.r.t.
the call's output as the product's. Ghost checks on the traced program that
the parameter reaches the call unchanged and is used nowhere else; what
happens inside the call it takes on trust from this module.

Parameters are float32, normal(`stddev`)-initialised and annotated with t5x
logical axis names (`nn.with_logical_partitioning`); a bias is zeros, with
the kernel's output axis name. No TensorFlow, no model code.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def _param(module: nn.Module, name: str, init, shape, axes):
  """A float32 parameter annotated with logical axis names."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      jnp.float32)


class Dense(nn.Module):
  """`x @ kernel (+ bias)` on the last axis, computed in `dtype`.

  Params: `kernel` `[x.shape[-1], features]` (axes `kernel_axes`), then, with
  `use_bias`, `bias` `[features]` (axis `kernel_axes[1]`).
  """
  features: int
  kernel_axes: tuple[str, str]
  stddev: float
  dtype: Any = jnp.float32
  use_bias: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = _param(self, "kernel", nn.initializers.normal(self.stddev),
                    (x.shape[-1], self.features), self.kernel_axes)
    y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
    if not self.use_bias:
      return y
    bias = _param(self, "bias", nn.initializers.zeros, (self.features,),
                  self.kernel_axes[1:])
    return y + bias.astype(self.dtype)


class Embed(nn.Module):
  """Embedding table `[num_embeddings, features]` (param `embedding`, axes
  `axes`); `attend` reuses it as the (tied) output projection."""
  num_embeddings: int
  features: int
  axes: tuple[str, str]
  stddev: float
  dtype: Any = jnp.float32

  def setup(self):
    self.embedding = _param(self, "embedding",
                            nn.initializers.normal(self.stddev),
                            (self.num_embeddings, self.features), self.axes)

  def __call__(self, ids: Array) -> Array:
    """`embedding[ids]`, cast to `dtype`."""
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

  def attend(self, x: Array) -> Array:
    """`x @ embedding.T` in float32 (logits precision)."""
    return jnp.dot(x.astype(jnp.float32), self.embedding.T)


__all__ = ["Dense", "Embed"]
