"""Token-level and per-example losses for sequence models.

Everything here is computed in float32 regardless of the logits' dtype, so a
bfloat16 model still gets a numerically stable loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Cross entropy of each target token under `logits`.

  Args:
    logits: `[..., L, vocab]` unnormalized scores.
    targets: `[..., L]` integer token ids.

  Returns:
    `[..., L]` float32 negative log-likelihoods.
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)
  return -picked[..., 0]


def per_example_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """Mean cross entropy over each example's weighted target tokens.

  `sum(xent * weights) / max(sum(weights), 1)` per example, so an example
  with no target tokens contributes a loss of 0 (not NaN).

  Args:
    logits: `[b, L, vocab]`.
    targets: `[b, L]` integer token ids.
    weights: `[b, L]` loss weights (0 at padding).

  Returns:
    `[b]` float32 losses.
  """
  weights = weights.astype(jnp.float32)
  xent = token_cross_entropy(logits, targets)
  total = jnp.sum(xent * weights, axis=-1)
  return total / jnp.maximum(jnp.sum(weights, axis=-1), 1.0)
