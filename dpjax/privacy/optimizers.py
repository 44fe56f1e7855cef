"""DP optimizers: `privatize` chained in front of any optax optimizer.

Formal guarantees
-----------------
`dp_optimizer(base, ...)` feeds `base` only the privatized release of
`dpjax.privacy.noise.privatize` (and the parameters, themselves a function of
earlier releases), so `base` is post-processing and the whole optimizer makes
exactly one Gaussian release with noise multiplier `noise_multiplier` per
`update` call. Its input must be the clipped gradient SUM of one logical batch
with L2 sensitivity `<= sensitivity`.
"""

from __future__ import annotations

from typing import Any

import optax

from dpjax.privacy import noise

LearningRate = float | optax.Schedule


def dp_optimizer(
    base: optax.GradientTransformation,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    seed: int,
) -> optax.GradientTransformation:
  """`optax.chain(privatize(...), base)`; see `noise.privatize` for the args."""
  return optax.chain(
      noise.privatize(noise_multiplier=noise_multiplier,
                      sensitivity=sensitivity, normalizer=normalizer,
                      seed=seed),
      base,
  )


def dp_sgd(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    seed: int,
    momentum: float | None = None,
) -> optax.GradientTransformation:
  """DP-SGD (optionally with momentum)."""
  return dp_optimizer(
      optax.sgd(learning_rate, momentum=momentum),
      noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer, seed=seed)


def dp_adam(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    seed: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
  """DP-Adam."""
  return dp_optimizer(
      optax.adam(learning_rate, b1=b1, b2=b2, eps=eps),
      noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer, seed=seed)


def dp_adamw(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    seed: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
) -> optax.GradientTransformation:
  """DP-AdamW; weight decay reads only the parameters, so it stays private."""
  return dp_optimizer(
      optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                  weight_decay=weight_decay),
      noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer, seed=seed)


def dp_adafactor(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    seed: int,
    **adafactor_kwargs: Any,
) -> optax.GradientTransformation:
  """DP-Adafactor; `adafactor_kwargs` go to `optax.adafactor`."""
  return dp_optimizer(
      optax.adafactor(learning_rate, **adafactor_kwargs),
      noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer, seed=seed)
