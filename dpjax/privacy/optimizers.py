"""DP optimizers: a mechanism's noisy release of the clipped sums, then an
optax optimizer.

Formal guarantees
-----------------
`DPOptimizer.update` feeds its `base` only the release of its `privatizer`
(and the parameters, themselves a function of earlier releases), so `base`
is post-processing. The privatizer is a mechanism's noise
(`dpjax.privacy.mechanisms`): each call makes that mechanism's releases of
one logical batch, keyed by the release index `count` and the secret
`noise_secret` it takes (the run's `secret.RunSecret.noise_key()`). Its
input must be the clipped sums of one logical batch, each with L2
sensitivity `<=` the sensitivity the privatizer was built for.

The release index is not optimizer state: it is the train state's
`noise_count`, kept beside `base`'s state, so a non-private step (a
redaction schedule's public step) runs `base` on the same state and leaves
the count, and with it every later release's noise, as it is. Likewise the
mechanism's own state (a clip bound that is a function of earlier releases;
correlated noise's past draws, secret) is the train state's `clip_norms`
and `noise_state`.

`freeze` runs `base` on the trained leaves only and zeroes the frozen
ones' updates (a data-independent mask: post-processing).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import optax

from dpjax.privacy import noise


class Privatizer(NamedTuple):
  """Noise as a transformation with its own state.

  `init(params) -> (clip_norms, noise_state)`: the mechanism's state at the
  first release (None where it keeps none). `update(sums, clip_norms,
  noise_state, count, noise_secret) -> (update, clip_norms, noise_state)`:
  release `count` of the named clipped sums as one update shaped like the
  params, and the state for the next release. `noise_state_shardings(
  noise_state, param_shardings, replicated)`: how a noise state is laid out
  on a mesh (None: it has none)."""
  init: Callable
  update: Callable
  noise_state_shardings: Callable | None = None


def gaussian_privatizer(*, noise_multipliers: Mapping[str, float],
                        sensitivities: Mapping[str, float], normalizer: float,
                        trainable: Any = None,
                        layouts: Any = None) -> Privatizer:
  """DP-SGD's release: `noise.privatizer(...)` (see it for the args and the
  guarantee), with no state."""
  privatize = noise.privatizer(noise_multipliers=noise_multipliers,
                               sensitivities=sensitivities,
                               normalizer=normalizer, trainable=trainable,
                               layouts=layouts)

  def update(sums, clip_norms, noise_state, count, noise_secret):
    return privatize(sums, count, noise_secret), clip_norms, noise_state

  return Privatizer(lambda params: (None, None), update)


class DPOptimizer(NamedTuple):
  """`privatizer` (named clipped sums -> one noisy mean update) and the
  `base` optax optimizer it feeds."""
  privatizer: Privatizer
  base: optax.GradientTransformation

  def init(self, params) -> optax.OptState:
    """The `base` optimizer's state for `params`."""
    return self.base.init(params)

  def update(self, sums: Mapping[str, Any], opt_state: optax.OptState, params,
             *, count: jax.Array, noise_secret: jax.Array,
             clip_norms: Any = None, noise_state: Any = None):
    """(updates, opt_state, clip_norms, noise_state): release `count` of
    `sums`, then `base`."""
    released, clip_norms, noise_state = self.privatizer.update(
        sums, clip_norms, noise_state, count, noise_secret)
    updates, opt_state = self.base.update(released, opt_state, params)
    return updates, opt_state, clip_norms, noise_state


def dp_optimizer(base: optax.GradientTransformation, *,
                 noise_multipliers: Mapping[str, float],
                 sensitivities: Mapping[str, float], normalizer: float,
                 trainable: Any = None, layouts: Any = None) -> DPOptimizer:
  """`base` fed by DP-SGD's `gaussian_privatizer(...)`."""
  return DPOptimizer(
      gaussian_privatizer(noise_multipliers=noise_multipliers,
                          sensitivities=sensitivities, normalizer=normalizer,
                          trainable=trainable, layouts=layouts), base)


def freeze(base: optax.GradientTransformation, trainable: Any
           ) -> optax.GradientTransformation:
  """`base` on the leaves where `trainable` is True only: the frozen leaves
  keep no optimizer state (LoRA's frozen base has no Adam moments) and
  their updates are exactly zero (they stay as they are, even under weight
  decay)."""
  frozen = jax.tree.map(lambda t: not t, trainable)
  return optax.chain(optax.masked(base, trainable),
                     optax.transforms.freeze(frozen))
