"""Gaussian noise for DP releases.

Formal guarantees
-----------------
`privatizer(noise_multipliers={name: z}, sensitivities={name: C}, ...)` turns
a sum `S(D)` whose L2 sensitivity is at most `C` (see
`dpjax.privacy.clipping`) into the release `(S(D) + N(0, (z C)^2 I)) /
normalizer`: one Gaussian mechanism with noise multiplier `z` per call. With
several named sums (one per loss, `clipping.multi_loss_clipped_grad`) it makes
one Gaussian per sum, with independent keys, added up afterwards. Dividing by
a data-independent `normalizer` and everything downstream (the base
optimizer, which only sees this release and the parameters) is
post-processing. How many releases were made, and on
which sampled batches, is what `dpjax.privacy.accounting` composes.

The noise comes from a counter-based PRNG keyed by `(secret, step)`, so it
is identical on every host and reproducible on resume. `secret` is 128 bits
from the run's `secret.RunSecret` (OS entropy), passed to `privatize` as the
argument `noise_secret` (a jit argument, never a compiled constant).
jax's threefry takes a 64-bit key, so each draw is the XOR of the bits of two
threefry streams keyed by the secret's two independent halves, then mapped
to a Gaussian as `jax.random.normal` maps its bits: guessing the noise means
guessing 128 bits. The guarantee assumes the secret stays secret, threefry
is a pseudorandom function, and PRNG floating-point samples are exact
Gaussians (the standard idealisation; not a proof against floating-point
attacks).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

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
  # Both streams in one threefry call over the pair (the same bits as two
  # calls): half the hash loops to compile, one per noised leaf.
  pair = jax.vmap(lambda k: jax.random.bits(k, shape, jnp.uint32))(keys)
  bits = pair[0] ^ pair[1]
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


def add_gaussian_noise(tree: PyTree, keys: jax.Array,
                       stddev: float | jax.Array,
                       layouts: PyTree | None = None) -> PyTree:
  """Adds independent `N(0, stddev^2)` to every coordinate of `tree`.

  `keys`: a pair from `noise_key`; leaf i gets split i of both. Leaves are
  returned as float32; `stddev == 0` returns the input (as float32) exactly.

  The leaves of one shape (and one `layouts` label) are drawn together, one
  `vmap` over their keys: the same bits as a draw per leaf, but one hash
  loop for XLA to compile per group instead of one per leaf (a model's
  layers repeat a few shapes: the tests' tiny T5 has 47 leaves of 6 shapes,
  and its noise compiled in 2.6 s instead of 6.7 s, with other work
  running). On a mesh, pass `layouts`, a hashable label per leaf (its
  logical axes; a prefix tree of `tree`): leaves of one shape but different
  layouts (a layer's input and output projections) are then drawn apart, so
  each group's stacked draw can take its leaves' one layout instead of
  moving noise between devices.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  labels = ([None] * len(leaves) if layouts is None
            else treedef.flatten_up_to(layouts))
  split = jax.vmap(lambda k: jax.random.split(k, len(leaves)))(keys)
  groups: dict[Any, list[int]] = {}
  for i, (leaf, label) in enumerate(zip(leaves, labels)):
    groups.setdefault((jnp.shape(leaf), label), []).append(i)
  noisy = [None] * len(leaves)
  for (shape, _), members in groups.items():
    draws = jax.vmap(lambda pair, shape=shape: standard_normal(pair, shape),
                     in_axes=1)(split[:, np.asarray(members)])
    for draw, i in zip(draws, members):
      noisy[i] = leaves[i].astype(jnp.float32) + stddev * draw
  return jax.tree_util.tree_unflatten(treedef, noisy)


def privatizer(
    *,
    noise_multipliers: Mapping[str, float],
    sensitivities: Mapping[str, float],
    normalizer: float,
    trainable: PyTree | None = None,
    layouts: PyTree | None = None,
) -> Callable[[Mapping[str, PyTree], jax.Array, jax.Array], PyTree]:
  """The noisy release of one logical batch's clipped sums.

  Returns `privatize(sums, count, noise_secret, scales=None) -> update`:
  `sums` is `{name: clipped gradient sum}` (one entry per named loss; a
  model with one loss is the case of one name), `count` the release index
  (the DP step: `TrainState.noise_count`) and `noise_secret` the run's
  secret noise key (uint32[4], `RunSecret.noise_key()`; there is no
  default). Each sum gets its own
  `N(0, (noise_multipliers[name] * sensitivities[name])^2 I)`; the noisy
  sums, each times `scales[name]` if given (a value fixed before this
  release, e.g. the adaptive clip norm: `adaptive_clipping`), are added and
  divided by `normalizer`, giving one update shaped like the params. Leaves
  where `trainable` is False (frozen) are never noised: their sums are
  zero, and so are their updates.

  Formal guarantees:
    If each `sums[name]` has L2 sensitivity `<= sensitivities[name]`, each
    call is one Gaussian mechanism per name, with noise multiplier
    `noise_multipliers[name]`, all on the same batch: account for T calls as
    `accounting.PoissonGaussian(q, tuple(noise_multipliers.values()), T)`.
    Call it exactly once per logical batch, however many microbatches built
    the sums, with a new `count` each time. A single release is keyed by
    `noise_key(noise_secret, count)`; release k of several by
    `fold_in(noise_key(noise_secret, count), k)` (in `noise_multipliers`'
    order), so the draws are independent of each other and of every other
    step's. The sum over names and the division by the data-independent
    `normalizer` are post-processing. A noise multiplier of 0 (ε = ∞) takes
    the same code path and adds exactly nothing.

  Args:
    noise_multipliers: name -> noise multiplier (>= 0).
    sensitivities: name -> L2 sensitivity (> 0); the same names.
    normalizer: Data-independent divisor: the expected batch size `q * N` for
      Poisson sampling, or the fixed batch size for shuffling. Dividing by the
      realised batch size instead would leak it.
    trainable: Optional bools shaped like the params.
    layouts: Optional hashable label per param (its logical axes), for
      `add_gaussian_noise`'s groups on a mesh; it changes no value.
  """
  names = list(noise_multipliers)
  if not names or set(names) != set(sensitivities):
    raise ValueError(f"noise_multipliers and sensitivities must name the same "
                     f"releases, got {names} and {list(sensitivities)}.")
  for name in names:
    if isinstance(noise_multipliers[name], jax.core.Tracer):
      pass  # an argument of the compiled step, checked where it was given
    elif not noise_multipliers[name] >= 0:
      raise ValueError(f"noise_multipliers[{name!r}] must be >= 0, got "
                       f"{noise_multipliers[name]}.")
    if not sensitivities[name] > 0:
      raise ValueError(f"sensitivities[{name!r}] must be > 0, got "
                       f"{sensitivities[name]}.")
  if not normalizer > 0:
    raise ValueError(f"normalizer must be > 0, got {normalizer}.")
  stddevs = {k: noise_multipliers[k] * sensitivities[k] for k in names}

  def privatize(sums, count, noise_secret, scales=None):
    if set(sums) != set(names):
      raise ValueError(f"expected the sums {names}, got {sorted(sums)}.")
    step_keys = noise_key(noise_secret, count)
    total = None
    for k, name in enumerate(names):
      keys = step_keys if len(names) == 1 else fold_in(step_keys, k)
      noisy = add_gaussian_noise(sums[name], keys, stddevs[name], layouts)
      if trainable is not None:  # frozen leaves: exactly the (zero) sum
        noisy = jax.tree_util.tree_map(
            lambda n, u, t: n if t else u.astype(jnp.float32), noisy,
            sums[name], trainable)
      if scales is not None:  # post-processing: e.g. back from units of C
        noisy = jax.tree_util.tree_map(lambda x: x * scales[name], noisy)
      total = noisy if total is None else jax.tree_util.tree_map(
          jnp.add, total, noisy)
    return jax.tree_util.tree_map(lambda x: x / normalizer, total)

  return privatize
