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

The noise comes from a counter-based PRNG keyed by `(secret, step)`, so it
is identical on every host and reproducible on resume. `secret` is 128 bits
from the run's `secret.RunSecret` (OS entropy), passed to `update` as the
extra argument `noise_secret` (a jit argument, never a compiled constant).
jax's threefry takes a 64-bit key, so each draw is the XOR of the bits of two
threefry streams keyed by the secret's two independent halves, then mapped
to a Gaussian as `jax.random.normal` maps its bits: guessing the noise means
guessing 128 bits. The guarantee assumes the secret stays secret, threefry
is a pseudorandom function, and PRNG floating-point samples are exact
Gaussians (the standard idealisation; not a proof against floating-point
attacks).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any

# Separates the noise stream from any other use of the same secret.
NOISE_STREAM_CONSTANT = 0x6E6F6973  # "nois"


def stream_keys(secret: jax.Array, stream: int, *data) -> jax.Array:
  """The threefry key pair [2] of `(secret, stream, *data)`.

  `secret`: uint32[4] (`RunSecret.noise_key()`); its halves key the two
  threefry streams whose bits `uniform` XORs. `stream` separates uses.
  """
  halves = jnp.asarray(secret, jnp.uint32).reshape(2, 2)

  def expand(half):
    key = jax.random.fold_in(
        jax.random.wrap_key_data(half, impl="threefry2x32"), stream)
    for d in data:
      key = jax.random.fold_in(key, d)
    return key

  return jax.vmap(expand)(halves)


def noise_key(secret: jax.Array, step: int | jax.Array) -> jax.Array:
  """The key pair of the noisy release at DP step `step`.

  Depends only on `(secret, step)`, so every host derives the same keys
  without communication and a resumed run redraws exactly the noise it
  would have.
  """
  return stream_keys(secret, NOISE_STREAM_CONSTANT, step)


def fold_in(keys: jax.Array, data: int | jax.Array) -> jax.Array:
  """`jax.random.fold_in` of both keys of a pair."""
  return jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)


def uniform(keys: jax.Array, shape, low: float, high: float = 1.0
            ) -> jax.Array:
  """float32 uniform in [low, high) from the XOR of the pair's bits, mapped
  as `jax.random.uniform` maps its bits; either key alone determines
  nothing."""
  bits = (jax.random.bits(keys[0], shape, jnp.uint32)
          ^ jax.random.bits(keys[1], shape, jnp.uint32))
  unit = jax.lax.bitcast_convert_type(
      (bits >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1)
  low, high = np.float32(low), np.float32(high)
  return jnp.maximum(low, unit * (high - low) + low)


def standard_normal(keys: jax.Array, shape) -> jax.Array:
  """float32 N(0, 1), by `jax.random.normal`'s inverse error function."""
  low = np.nextafter(np.float32(-1.0), np.float32(0.0))
  return np.float32(np.sqrt(2.0)) * jax.lax.erf_inv(uniform(keys, shape, low))


def standard_laplace(keys: jax.Array, shape) -> jax.Array:
  """float32 Laplace(0, 1) (density exp(-|z|) / 2), by
  `jax.random.laplace`'s inverse CDF."""
  u = uniform(keys, shape, np.nextafter(np.float32(-1.0), np.float32(0.0)))
  return -jnp.sign(u) * jnp.log1p(-jnp.abs(u))


def add_gaussian_noise(
    tree: PyTree, keys: jax.Array, stddev: float | jax.Array) -> PyTree:
  """Adds independent `N(0, stddev^2)` to every coordinate of `tree`.

  `keys`: a pair from `noise_key`; each leaf gets its own split of both.
  Leaves are returned as float32; `stddev == 0` returns the input (as
  float32) exactly.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  split = jax.vmap(lambda k: jax.random.split(k, len(leaves)))(keys)
  noisy = [
      leaf.astype(jnp.float32)
      + stddev * standard_normal(split[:, i], jnp.shape(leaf))
      for i, leaf in enumerate(leaves)
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
) -> optax.GradientTransformationExtraArgs:
  """Adds calibrated Gaussian noise to a clipped-gradient sum, then normalizes.

  Formal guarantees:
    Given `updates` = the sum of clipped per-example gradients of one logical
    batch, with L2 sensitivity `<= sensitivity`, each `update` call is one
    Gaussian mechanism with noise multiplier `noise_multiplier`: it returns
    `(updates + N(0, (noise_multiplier * sensitivity)^2 I)) / normalizer`,
    with noise keyed by `noise_key(noise_secret, count)` and `count`
    incremented by one. Call it exactly once per logical batch, however many
    microbatches built the sum. `noise_multiplier == 0` (epsilon = inf)
    takes the same code path and returns exactly `updates / normalizer`.

  Args:
    noise_multiplier: Noise standard deviation in units of the sensitivity.
    sensitivity: L2 sensitivity of `updates`, e.g. `ClippedGradFn.sensitivity`.
    normalizer: Data-independent divisor: the expected batch size `q * N` for
      Poisson sampling, or the fixed batch size for shuffling. Dividing by the
      realised batch size instead would leak it.

  Returns:
    An optax `GradientTransformationExtraArgs` with state `PrivatizeState`
    whose `update(updates, state, params, *, noise_secret)` takes the run's
    secret noise key (uint32[4], `RunSecret.noise_key()`); there is no
    default key.
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

  def update_fn(updates, state, params=None, *, noise_secret, **extra_args):
    del params, extra_args
    noisy = add_gaussian_noise(updates, noise_key(noise_secret, state.count),
                               stddev)
    updates = jax.tree_util.tree_map(lambda x: x / normalizer, noisy)
    return updates, PrivatizeState(count=state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def privatize_releases(
    *,
    noise_multipliers: Mapping[str, float],
    sensitivities: Mapping[str, float],
    normalizer: float,
    trainable: PyTree | None = None,
) -> optax.GradientTransformationExtraArgs:
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
    `fold_in(noise_key(noise_secret, count), k)`, so the draws are
    independent of each other and of every other step's. The sum over names
    and the division are post-processing.

  Args:
    noise_multipliers: name -> noise multiplier (>= 0).
    sensitivities: name -> L2 sensitivity (> 0); the same names.
    normalizer: As in `privatize`.
    trainable: Optional bools shaped like the params.

  Returns:
    An optax `GradientTransformationExtraArgs` with state `PrivatizeState`
    (the same state as `privatize`'s, so public steps treat both alike) and
    `privatize`'s `noise_secret` argument.
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

  def update_fn(updates, state, params=None, *, noise_secret, **extra_args):
    del params, extra_args
    if set(updates) != set(names):
      raise ValueError(f"expected the sums {names}, got {sorted(updates)}.")
    step_keys = noise_key(noise_secret, state.count)
    total = None
    for k, name in enumerate(names):
      noisy = add_gaussian_noise(updates[name], fold_in(step_keys, k),
                                 stddevs[name])
      if trainable is not None:  # frozen leaves: exactly the (zero) sum
        noisy = jax.tree_util.tree_map(
            lambda n, u, t: n if t else u.astype(jnp.float32), noisy,
            updates[name], trainable)
      total = noisy if total is None else jax.tree_util.tree_map(
          jnp.add, total, noisy)
    updates = jax.tree_util.tree_map(lambda x: x / normalizer, total)
    return updates, PrivatizeState(count=state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
