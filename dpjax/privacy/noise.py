"""Gaussian noise for DP releases, as an optax gradient transformation.

Formal guarantees
-----------------
`privatize(noise_multiplier=z, sensitivity=C, ...)` turns a sum `S(D)` whose
L2 sensitivity is at most `C` (see `dpjax.privacy.clipping`) into the release
`(S(D) + N(0, (z C)^2 I)) / normalizer`: one Gaussian mechanism with noise
multiplier `z` per `update` call. `privatize_releases` does the same for
several sums at once (one per named loss, `clipping.multi_loss_clipped_grad`):
one Gaussian per sum, with independent keys, added up afterwards. Dividing by a data-independent `normalizer`
and everything downstream (the base optimizer, which only sees this release
and the parameters) is post-processing. How many releases were made, and on
which sampled batches, is what `dpjax.privacy.accounting` composes.

The noise comes from a counter-based PRNG keyed by `(seed, step)`, so it is
identical on every host and reproducible on resume. The guarantee assumes the
seed is secret and treats PRNG floating-point samples as exact Gaussians
(the standard idealisation; it is not a proof against floating-point attacks).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any

# Separates the noise stream from any other use of the same seed.
NOISE_STREAM_CONSTANT = 0x6E6F6973  # "nois"


def noise_key(seed: int, step: int | jax.Array) -> jax.Array:
  """The PRNG key for the noisy release at DP step `step`.

  Depends only on `(seed, step)`, so every host derives the same key without
  communication and a resumed run redraws exactly the noise it would have.
  """
  base = jax.random.fold_in(jax.random.PRNGKey(seed), NOISE_STREAM_CONSTANT)
  return jax.random.fold_in(base, step)


def add_gaussian_noise(
    tree: PyTree, key: jax.Array, stddev: float | jax.Array) -> PyTree:
  """Adds independent `N(0, stddev^2)` to every coordinate of `tree`.

  Each leaf gets its own split of `key`; leaves are returned as float32.
  `stddev == 0` returns the input (as float32) exactly.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(key, len(leaves))
  noisy = [
      leaf.astype(jnp.float32)
      + stddev * jax.random.normal(k, jnp.shape(leaf), jnp.float32)
      for leaf, k in zip(leaves, keys)
  ]
  return jax.tree_util.tree_unflatten(treedef, noisy)


class PrivatizeState(NamedTuple):
  """`count`: number of noisy releases made so far (the DP step index)."""

  count: jax.Array


def privatize(
    *,
    noise_multiplier: float,
    sensitivity: float,
    normalizer: float,
    seed: int,
) -> optax.GradientTransformation:
  """Adds calibrated Gaussian noise to a clipped-gradient sum, then normalizes.

  Formal guarantees:
    Given `updates` = the sum of clipped per-example gradients of one logical
    batch, with L2 sensitivity `<= sensitivity`, each `update` call is one
    Gaussian mechanism with noise multiplier `noise_multiplier`: it returns
    `(updates + N(0, (noise_multiplier * sensitivity)^2 I)) / normalizer`,
    with noise keyed by `noise_key(seed, count)` and `count` incremented by
    one. Call it exactly once per logical batch, however many microbatches
    built the sum. `noise_multiplier == 0` (epsilon = inf) takes the same code
    path and returns exactly `updates / normalizer`.

  Args:
    noise_multiplier: Noise standard deviation in units of the sensitivity.
    sensitivity: L2 sensitivity of `updates`, e.g. `ClippedGradFn.sensitivity`.
    normalizer: Data-independent divisor: the expected batch size `q * N` for
      Poisson sampling, or the fixed batch size for shuffling. Dividing by the
      realised batch size instead would leak it.
    seed: Noise seed; must be kept secret.

  Returns:
    An optax `GradientTransformation` with state `PrivatizeState`.
  """
  if not noise_multiplier >= 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
  if not sensitivity > 0:
    raise ValueError(f"sensitivity must be > 0, got {sensitivity}.")
  if not normalizer > 0:
    raise ValueError(f"normalizer must be > 0, got {normalizer}.")
  stddev = noise_multiplier * sensitivity

  def init_fn(params):
    del params
    return PrivatizeState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    noisy = add_gaussian_noise(updates, noise_key(seed, state.count), stddev)
    updates = jax.tree_util.tree_map(lambda x: x / normalizer, noisy)
    return updates, PrivatizeState(count=state.count + 1)

  return optax.GradientTransformation(init_fn, update_fn)


def privatize_releases(
    *,
    noise_multipliers: Mapping[str, float],
    sensitivities: Mapping[str, float],
    normalizer: float,
    seed: int,
    trainable: PyTree | None = None,
) -> optax.GradientTransformation:
  """`privatize` for several clipped sums of one batch, noised separately.

  `updates` is `{name: clipped grad sum}` (the output of
  `clipping.multi_loss_clipped_grad`); each sum gets its own
  `N(0, (noise_multipliers[name] * sensitivities[name])^2 I)`, then the noisy
  sums are added and divided by `normalizer`, giving one update shaped like
  the params. Leaves where `trainable` is False (frozen) are never noised:
  their sums are zero, and so are their updates.

  Formal guarantees:
    If each `updates[name]` has L2 sensitivity `<= sensitivities[name]`, each
    `update` call is one Gaussian mechanism per name, with noise multiplier
    `noise_multipliers[name]`, all on the same batch: account for them as
    `accounting.PoissonGaussian(q, tuple(noise_multipliers.values()), T)`.
    Release k (in `noise_multipliers`' order) is keyed by
    `fold_in(noise_key(seed, count), k)`, so the draws are independent of
    each other and of every other step's. The sum over names and the
    division are post-processing.

  Args:
    noise_multipliers: name -> noise multiplier (>= 0).
    sensitivities: name -> L2 sensitivity (> 0); the same names.
    normalizer, seed: As in `privatize`.
    trainable: Optional bools shaped like the params.

  Returns:
    An optax `GradientTransformation` with state `PrivatizeState` (the same
    state as `privatize`'s, so public steps treat both alike).
  """
  names = list(noise_multipliers)
  if not names or set(names) != set(sensitivities):
    raise ValueError(f"noise_multipliers and sensitivities must name the same "
                     f"releases, got {names} and {list(sensitivities)}.")
  for name in names:
    if not noise_multipliers[name] >= 0:
      raise ValueError(f"noise_multipliers[{name!r}] must be >= 0, got "
                       f"{noise_multipliers[name]}.")
    if not sensitivities[name] > 0:
      raise ValueError(f"sensitivities[{name!r}] must be > 0, got "
                       f"{sensitivities[name]}.")
  if not normalizer > 0:
    raise ValueError(f"normalizer must be > 0, got {normalizer}.")
  stddevs = {k: noise_multipliers[k] * sensitivities[k] for k in names}

  def init_fn(params):
    del params
    return PrivatizeState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    if set(updates) != set(names):
      raise ValueError(f"expected the sums {names}, got {sorted(updates)}.")
    step_key = noise_key(seed, state.count)
    total = None
    for k, name in enumerate(names):
      noisy = add_gaussian_noise(updates[name], jax.random.fold_in(step_key, k),
                                 stddevs[name])
      if trainable is not None:  # frozen leaves: exactly the (zero) sum
        noisy = jax.tree_util.tree_map(
            lambda n, u, t: n if t else u.astype(jnp.float32), noisy,
            updates[name], trainable)
      total = noisy if total is None else jax.tree_util.tree_map(
          jnp.add, total, noisy)
    updates = jax.tree_util.tree_map(lambda x: x / normalizer, total)
    return updates, PrivatizeState(count=state.count + 1)

  return optax.GradientTransformation(init_fn, update_fn)
