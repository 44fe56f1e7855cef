"""DP optimizers: `privatize` chained in front of any optax optimizer.

Formal guarantees
-----------------
`dp_optimizer(base, ...)` feeds `base` only the privatized release of
`dpjax.privacy.noise.privatize` (and the parameters, themselves a function of
earlier releases), so `base` is post-processing and the whole optimizer makes
exactly one Gaussian release with noise multiplier `noise_multiplier` per
`update` call, keyed by the `noise_secret` every `update` takes (the run's
`secret.RunSecret.noise_key()`). Its input must be the clipped gradient SUM of one logical batch
with L2 sensitivity `<= sensitivity`. `dp_optimizer_releases(base, ...)` is
the same with one Gaussian release per named clipped sum
(`noise.privatize_releases`): k releases per `update` call.

`freeze(base, trainable)` zeroes `base`'s updates of the frozen leaves (a
data-independent mask: post-processing).

`public_update(base)` updates the same optimizer state with `base` alone and
makes no release: it is post-processing only when its gradient is computed
from public data and the current parameters (see
`dpjax.privacy.redaction_schedule`). It leaves the noise counter as it is, so
noise stays keyed by the release index.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import optax

from dpjax.privacy import noise

LearningRate = float | optax.Schedule


def dp_optimizer(
    base: optax.GradientTransformation,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
) -> optax.GradientTransformation:
  """`optax.chain(privatize(...), base)`; see `noise.privatize` for the args."""
  return optax.chain(
      noise.privatize(noise_multiplier=noise_multiplier,
                      sensitivity=sensitivity, normalizer=normalizer),
      base,
  )


def dp_optimizer_releases(
    base: optax.GradientTransformation,
    *,
    noise_multipliers: Mapping[str, float],
    sensitivities: Mapping[str, float],
    normalizer: float,
    trainable: Any = None,
) -> optax.GradientTransformation:
  """`optax.chain(privatize_releases(...), base)`: several clipped sums of one
  batch, each noised as its own release, added, then `base`; see
  `noise.privatize_releases` for the args. The state has the layout of
  `dp_optimizer`'s, so `public_update` works on it too."""
  return optax.chain(
      noise.privatize_releases(noise_multipliers=noise_multipliers,
                               sensitivities=sensitivities,
                               normalizer=normalizer,
                               trainable=trainable),
      base,
  )


def noise_count(opt_state: optax.OptState) -> jax.Array:
  """The releases a `dp_optimizer` (or `dp_optimizer_releases`) state has
  made: its `privatize` noise counter."""
  return opt_state[0].count


def freeze(base: optax.GradientTransformation, trainable: Any
           ) -> optax.GradientTransformation:
  """`base` whose updates of the leaves where `trainable` is False are zero
  (frozen layers stay as they are, even under weight decay)."""
  frozen = jax.tree.map(lambda t: not t, trainable)
  return optax.chain(base, optax.masked(optax.set_to_zero(), frozen))


def public_update(base: optax.GradientTransformation
                  ) -> optax.TransformUpdateFn:
  """A non-private update of `dp_optimizer(base, ...)`'s state.

  Returns `update(grads, state, params) -> (updates, state)` that hands the
  (mean, unclipped, un-noised) `grads` to `base` and returns the DP
  optimizer's state with `base`'s part (moments, step count, learning-rate
  schedule position) advanced, so DP and public steps share one optimizer;
  `privatize`'s noise counter comes back unchanged.
  """

  def update_fn(grads, state, params=None):
    privatize_state, base_state = state
    updates, base_state = base.update(grads, base_state, params)
    return updates, (privatize_state, base_state)

  return update_fn


def dp_sgd(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    momentum: float | None = None,
) -> optax.GradientTransformation:
  """DP-SGD (optionally with momentum)."""
  return dp_optimizer(
      optax.sgd(learning_rate, momentum=momentum),
      noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer)


def dp_adam(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
  """DP-Adam."""
  return dp_optimizer(
      optax.adam(learning_rate, b1=b1, b2=b2, eps=eps),
      noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer)


def dp_adamw(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
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
      normalizer=normalizer)


def dp_adafactor(
    learning_rate: LearningRate,
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    **adafactor_kwargs: Any,
) -> optax.GradientTransformation:
  """DP-Adafactor; `adafactor_kwargs` go to `optax.adafactor`."""
  return dp_optimizer(
      optax.adafactor(learning_rate, **adafactor_kwargs),
      noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer)
