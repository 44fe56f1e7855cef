"""DP optimizers: the noisy release of the clipped sums, then an optax one.

Formal guarantees
-----------------
`DPOptimizer.update` feeds its `base` only the privatized release of
`dpjax.privacy.noise.privatizer` (and the parameters, themselves a function
of earlier releases), so `base` is post-processing and each call makes
exactly one Gaussian release per named sum, keyed by the release index
`count` and the secret `noise_secret` it takes (the run's
`secret.RunSecret.noise_key()`). Its input must be the clipped gradient sums
of one logical batch, each with L2 sensitivity `<=` its `sensitivities`
entry; a model with one loss has one name.

The release index is not optimizer state: it is the train state's
`noise_count`, kept beside `base`'s state, so a non-private step (a
redaction schedule's public step) runs `base` on the same state and leaves
the count, and with it every later release's noise, as it is.

`bandmf_optimizer`: the same with BandMF's correlated noise
(`dpjax.privacy.bandmf`); its noise state is the train state's
`noise_state`, and secret.

`freeze` runs `base` on the trained leaves only and zeroes the frozen
ones' updates (a data-independent mask: post-processing).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import optax

from dpjax.privacy import bandmf, noise


class DPOptimizer(NamedTuple):
  """`privatize` (named clipped sums -> one noisy mean update) and the `base`
  optax optimizer it feeds; with adaptive clipping, the bounds the train
  state starts from (`{name: C}`, `train_step.init_state`). With correlated
  noise (`bandmf.correlated_privatizer`), `noise_state_init(params)` gives
  the noise state the train state carries, and `privatize` takes and
  returns it."""
  privatize: Callable
  base: optax.GradientTransformation
  initial_clip_norms: Mapping[str, float] | None = None
  noise_state_init: Callable | None = None

  def init(self, params) -> optax.OptState:
    return self.base.init(params)

  def update(self, sums: Mapping[str, Any], opt_state: optax.OptState, params,
             *, count: jax.Array, noise_secret: jax.Array,
             scales: Mapping[str, jax.Array] | None = None,
             noise_state: Any = None):
    """(updates, opt_state, noise_state): release `count` of `sums` (each
    noisy sum times its `scales` entry, if given), then `base`."""
    if self.noise_state_init is None:
      released = self.privatize(sums, count, noise_secret, scales)
    else:
      released, noise_state = self.privatize(sums, count, noise_secret,
                                             scales, noise_state)
    updates, opt_state = self.base.update(released, opt_state, params)
    return updates, opt_state, noise_state


def dp_optimizer(
    base: optax.GradientTransformation,
    *,
    noise_multipliers: Mapping[str, float],
    sensitivities: Mapping[str, float],
    normalizer: float,
    trainable: Any = None,
    initial_clip_norms: Mapping[str, float] | None = None,
) -> DPOptimizer:
  """`base` fed by `noise.privatizer(...)`; see it for the args.
  `initial_clip_norms`: adaptive clipping's first bounds (the sums are then
  in units of the state's bounds, and `sensitivities` are 1)."""
  return DPOptimizer(
      noise.privatizer(noise_multipliers=noise_multipliers,
                       sensitivities=sensitivities, normalizer=normalizer,
                       trainable=trainable),
      base, None if initial_clip_norms is None else dict(initial_clip_norms))


def bandmf_optimizer(base: optax.GradientTransformation, strategy, *,
                     noise_multiplier: float, sensitivity: float,
                     normalizer: float, trainable: Any = None) -> DPOptimizer:
  """`base` fed by `bandmf.correlated_privatizer(strategy, ...)`."""
  init, privatize = bandmf.correlated_privatizer(
      strategy, noise_multiplier=noise_multiplier, sensitivity=sensitivity,
      normalizer=normalizer, trainable=trainable)
  return DPOptimizer(privatize, base, noise_state_init=init)


def freeze(base: optax.GradientTransformation, trainable: Any
           ) -> optax.GradientTransformation:
  """`base` on the leaves where `trainable` is True only: the frozen leaves
  keep no optimizer state (LoRA's frozen base has no Adam moments) and
  their updates are exactly zero (they stay as they are, even under weight
  decay)."""
  frozen = jax.tree.map(lambda t: not t, trainable)
  return optax.chain(optax.masked(base, trainable),
                     optax.transforms.freeze(frozen))
