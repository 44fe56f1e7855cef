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
argument `noise_secret` (a jit argument, never a compiled constant). Its two
64-bit halves are each expanded by jax's threefry (`fold_in` of the stream
and the step, `split` per leaf) into a pair of keys, whose 128 bits key
Threefry-4x32-20 (`threefry4x32`, the 128-bit-key member of jax's own
generator's family) over each position's counter; its bits are mapped to a
Gaussian as `jax.random.normal` maps its bits. Guessing the noise means
guessing 128 bits. The guarantee assumes the secret stays secret, threefry
is a pseudorandom function, and PRNG floating-point samples are exact
Gaussians (the standard idealisation; not a proof against floating-point
attacks).

One Threefry-4x32 block gives four 32-bit words: where an array's rows
allow, four runs of its rows take one block's words (`_draw`);
elsewhere each position takes a block's first word. A position then costs
a quarter of a block, or one.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

# Separates the noise stream from any other use of the same secret.
NOISE_STREAM_CONSTANT = 0x6E6F6973  # "nois"


def stream_keys(secret: jax.Array, stream: int, *data) -> jax.Array:
  """The threefry key pair [2] of `(secret, stream, *data)`.

  `secret`: uint32[4] (`RunSecret.noise_key()`); each half is expanded
  into one key of the pair, whose 128 bits key `uniform`'s Threefry-4x32.
  `stream` separates uses.
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


# Threefry-4x32's rotation constants and key-schedule parity (Random123's
# threefry.h; Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
# SC 2011).
_ROTATIONS = ((10, 26), (11, 21), (13, 27), (23, 5), (6, 20), (17, 11),
              (25, 10), (18, 20))
_PARITY = np.uint32(0x1BD11BDA)
_ROUNDS = 20


def threefry4x32(key, counter) -> list[jax.Array]:
  """Threefry-4x32-20: the four uint32 words of the block `counter` under
  the 128-bit `key`, each a sequence of four uint32 words (arrays that
  broadcast together; Random123's word order).

  Straight-line code on accelerators (XLA fuses it into its consumer); on
  CPUs a loop over the five key injections, as jax's own threefry is
  lowered there, which XLA:CPU compiles in half the time.
  """
  key = [jnp.asarray(k, jnp.uint32) for k in key]
  schedule = key + [key[0] ^ key[1] ^ key[2] ^ key[3] ^ _PARITY]
  # One shape for the four words (a loop carries them); the key's stay.
  x = jnp.broadcast_arrays(*(jnp.asarray(c, jnp.uint32) + k
                             for c, k in zip(counter, key)))

  def injection(s, x, schedule, rotations):
    """Four rounds (`rotations[j]` the pair of round j), then injection
    `s` of the key schedule, `schedule` rotated left by `s - 1`."""
    x = list(x)
    for j, (a, b) in enumerate(rotations):
      # Even rounds mix words (0, 1) and (2, 3), odd rounds (0, 3), (2, 1).
      p, q = (1, 3) if j % 2 == 0 else (3, 1)
      x[0] = x[0] + x[p]
      x[p] = _rotl(x[p], a) ^ x[0]
      x[2] = x[2] + x[q]
      x[q] = _rotl(x[q], b) ^ x[2]
    schedule = schedule[1:] + schedule[:1]
    x = [w + k for w, k in zip(x, schedule)]
    x[3] = x[3] + s
    return x, schedule

  def unrolled(x, schedule):
    for s in range(1, _ROUNDS // 4 + 1):
      x, schedule = injection(np.uint32(s), x, schedule,
                              _ROTATIONS[4 * ((s - 1) % 2):][:4])
    return x

  def rolled(x, schedule):
    table = jnp.asarray(_ROTATIONS, jnp.uint32).reshape(2, 4, 2)

    def body(i, carry):
      rotations = table[i % 2]
      return injection((i + 1).astype(jnp.uint32), *carry,
                       [(rotations[j, 0], rotations[j, 1]) for j in range(4)])

    return jax.lax.fori_loop(0, _ROUNDS // 4, body, (x, schedule))[0]

  return jax.lax.platform_dependent(x, schedule, cpu=rolled, default=unrolled)


def _rotl(x, r):
  return (x << r) | (x >> (np.uint32(32) - r))


def _positions(shape) -> tuple[jax.Array, jax.Array]:
  """Two uint32 words `(low, high)` numbering the positions of `shape`
  one-to-one: the row-major index over the trailing axes whose sizes
  multiply to under 2^32, and over the leading ones. Each is an iota sum,
  which a sharded array's devices compute for their own block."""
  split, size = len(shape), 1
  while split and size * shape[split - 1] < 2**32:
    split, size = split - 1, size * shape[split - 1]
  if math.prod(shape[:split]) >= 2**32:
    raise ValueError(f"cannot number the {math.prod(shape)} positions of "
                     f"{shape} in 64 bits.")

  def index(axes):
    flat = jnp.zeros(shape, jnp.uint32)
    for axis in axes:
      flat = (flat * np.uint32(shape[axis])
              + jax.lax.broadcasted_iota(jnp.uint32, shape, axis))
    return flat

  return index(range(split, len(shape))), index(range(split))


def _draw(keys: jax.Array, shape, transform: Callable) -> jax.Array:
  """`transform` (elementwise, of uint32 bits) of bits of `shape` from
  Threefry-4x32 keyed by the pair `keys`' 128 bits (`key_data` row by row).

  Where an array's second-to-last axis (its rows) is a multiple of 32, a
  block's four words go to four consecutive runs of 8 rows: a TPU tiles
  float32 rows eight at a time, so the runs merge into the array without a
  copy, and the rows axis is the one an array's shards least often split
  (a stacked layer's leading axis often is). Elsewhere each position takes
  a block's first word. Either way a position's bits depend on its index
  alone, so a sharded array's devices compute their own, with no
  communication where a shard's rows are a multiple of 32. `transform`
  is applied before the words are laid out (per platform, below).
  """
  key = jnp.ravel(jax.random.key_data(keys))
  shape = tuple(shape)
  if len(shape) >= 2 and shape[-2] % 32 == 0:
    low, high = _positions((*shape[:-2], shape[-2] // 32, 8, shape[-1]))
    words = threefry4x32(key, (low, high, 0, 0))
    # Each word is mapped on its own: the TPU compiler then writes values
    # once, not the bits first. On a GPU the words pass a barrier: its
    # compiler fuses a block's rounds into its words' consumers and
    # computes blocks again (138.5 FLOPs a value against 100 at 12 x 768 x
    # 3072). XLA:CPU maps the four at once: one transform to compile.
    each = lambda *w: jnp.stack([transform(x) for x in w], axis=-3)
    values = jax.lax.platform_dependent(
        *words, default=each,
        cuda=lambda *w: each(*jax.lax.optimization_barrier(w)),
        cpu=lambda *w: jnp.moveaxis(transform(jnp.stack(w)), 0, -3))
    return values.reshape(shape)
  low, high = _positions(shape)
  return transform(threefry4x32(key, (low, high, 0, 0))[0])


def _unit(bits: jax.Array, low: float, high: float = 1.0) -> jax.Array:
  """float32 in [low, high) from uint32 bits, as `jax.random.uniform`
  maps them."""
  unit = jax.lax.bitcast_convert_type(
      (bits >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1)
  low, high = np.float32(low), np.float32(high)
  return jnp.maximum(low, unit * (high - low) + low)


_OPEN_BELOW = np.nextafter(np.float32(-1.0), np.float32(0.0))


def uniform(keys: jax.Array, shape, low: float, high: float = 1.0
            ) -> jax.Array:
  """float32 uniform in [low, high) from the pair's Threefry-4x32 bits
  (`_draw`), mapped as `jax.random.uniform` maps its bits; either key alone
  determines nothing. One draw per pair: another shape under the same pair
  would reuse counters."""
  return _draw(keys, shape, lambda bits: _unit(bits, low, high))


def standard_normal(keys: jax.Array, shape) -> jax.Array:
  """float32 N(0, 1), by `jax.random.normal`'s inverse error function."""
  return _draw(keys, shape, lambda bits: np.float32(np.sqrt(2.0))
               * jax.lax.erf_inv(_unit(bits, _OPEN_BELOW)))


def standard_laplace(keys: jax.Array, shape) -> jax.Array:
  """float32 Laplace(0, 1) (density exp(-|z|) / 2), by
  `jax.random.laplace`'s inverse CDF."""

  def laplace(bits):
    u = _unit(bits, _OPEN_BELOW)
    return -jnp.sign(u) * jnp.log1p(-jnp.abs(u))

  return _draw(keys, shape, laplace)


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
