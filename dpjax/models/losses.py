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
  logits = logits.astype(jnp.float32)
  # The target's logit by a one-hot select, not a gather: a gather's
  # gradient is a scatter, which TPUs run as a loop over the rows (and
  # per-example gradients make it one per example); a select fuses with the
  # logsumexp and its gradient with the softmax's.
  is_target = targets[..., None] == jnp.arange(logits.shape[-1])
  picked = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
  return jax.nn.logsumexp(logits, axis=-1) - picked


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


def next_token_loss(logits: jax.Array, tokens: jax.Array, weights: jax.Array) -> jax.Array:
  """`per_example_loss` of predicting `tokens[:, t+1]` from `logits[:, t]`,
  weighted by `weights[:, t+1]` (a causal LM's; position 0 has no
  prediction).

  Takes every position's logits, the last one's at weight 0, rather than
  the logits sliced: a slice between the output projection and the
  logsumexp keeps a TPU from fusing the max into the projection, and ghost
  clipping then reads the float32 logits once more an example.

  Args:
    logits: `[b, L, vocab]`.
    tokens: `[b, L]` integer token ids.
    weights: `[b, L]` loss weights of the tokens as targets.

  Returns:
    `[b]` float32 losses.
  """
  shift = lambda x: jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)
  return per_example_loss(logits, shift(tokens), shift(weights))
