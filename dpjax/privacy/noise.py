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
allow, four runs of its rows take one block's words (`_draws`);
elsewhere each position takes a block's first word. A position then costs
a quarter of a block, or one.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
from jax import lax
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


def threefry4x32(key, counter, rolled: bool = False) -> list[jax.Array]:
  """Threefry-4x32-20: the four uint32 words of the block `counter` under
  the 128-bit `key`, each a sequence of four uint32 words (arrays that
  broadcast together; Random123's word order).

  Straight-line code by default (an accelerator's compiler fuses it into
  its consumer); `rolled`, a loop over the five key injections, as jax's
  own threefry is lowered for CPUs, which XLA:CPU compiles in half the
  time. Written in `lax` operations, which trace in a fraction of the time
  of `jnp`'s operators.
  """
  key = [jnp.asarray(k, jnp.uint32) for k in key]
  schedule = key + [_xor(*key, _PARITY)]
  # One shape for the four words (a loop carries them); the key's stay.
  x = jnp.broadcast_arrays(*(jnp.asarray(c, jnp.uint32) + k
                             for c, k in zip(counter, key)))

  def rounds(x, rotations):
    """Four rounds, `rotations[j]` the pair of round j."""
    x = list(x)
    for j, (a, b) in enumerate(rotations):
      # Even rounds mix words (0, 1) and (2, 3), odd rounds (0, 3), (2, 1).
      p, q = (1, 3) if j % 2 == 0 else (3, 1)
      x[0] = lax.add(x[0], x[p])
      x[p] = _xor(_rotl(x[p], a), x[0])
      x[2] = lax.add(x[2], x[q])
      x[q] = _xor(_rotl(x[q], b), x[2])
    return x

  # Injection s adds the schedule rotated left by s, and s to the last word.
  if not rolled:
    for s in range(1, _ROUNDS // 4 + 1):
      x = rounds(x, _ROTATIONS[4 * ((s - 1) % 2):][:4])
      x = [lax.add(w, schedule[(s + j) % 5]) for j, w in enumerate(x)]
      x[3] = lax.add(x[3], np.uint32(s))
    return x
  table = jnp.asarray(_ROTATIONS, jnp.uint32).reshape(2, 4, 2)
  # The loop reads the schedule, never writes it (it may be as large as x).
  schedule = jnp.stack(jnp.broadcast_arrays(*schedule))

  def body(i, x):
    x = rounds(x, [(table[i % 2, j, 0], table[i % 2, j, 1]) for j in range(4)])
    s = (i + 1).astype(jnp.uint32)
    x = [lax.add(w, lax.dynamic_index_in_dim(schedule, (s + j) % 5, 0, False))
         for j, w in enumerate(x)]
    x[3] = lax.add(x[3], s)
    return x

  return jax.lax.fori_loop(0, _ROUNDS // 4, body, x)


def _xor(*words):
  out = words[0]
  for w in words[1:]:
    out = lax.bitwise_xor(out, w)
  return out


def _rotl(x, r):
  """`x` rotated left by `r` bits (a Python int, or a traced uint32)."""
  if isinstance(r, int):
    r, rest = np.uint32(r), np.uint32(32 - r)
  else:
    rest = lax.sub(np.uint32(32), r)
  return lax.bitwise_or(lax.shift_left(x, r), lax.shift_right_logical(x, rest))


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


def _draws(requests: Sequence[tuple[jax.Array, Any]],
           transform: Callable) -> list[jax.Array]:
  """For each `(keys, shape)` of `requests`, `transform` (elementwise, of
  uint32 bits) of bits of `shape` from Threefry-4x32 keyed by the pair
  `keys`' 128 bits (`key_data` row by row). `keys` may also be pairs
  stacked on leading axes, `(*batch, 2)`: the draw is then `(*batch,
  *shape)`, each pair's the same as alone (a key that broadcasts, where a
  `vmap` would trace the platforms' branches again).

  Where an array's second-to-last axis (its rows) is a multiple of 32, a
  block's four words go to four consecutive runs of 8 rows: a TPU tiles
  float32 rows eight at a time, so the runs merge into the array without a
  copy, and the rows axis is the one an array's shards least often split
  (a stacked layer's leading axis often is). Elsewhere each position takes
  a block's first word. Either way a position's bits depend on its index
  alone, so a sharded array's devices compute their own, with no
  communication where a shard's rows are a multiple of 32.

  Accelerators hash each request where it is laid out (`_straight`), CPUs
  in rolled loops, the small requests sharing one (`_rolled`); the bits
  are the same.
  """
  plans = [_plan(keys, shape) for keys, shape in requests]
  return jax.lax.platform_dependent(
      cpu=lambda: _rolled(plans, transform),
      default=lambda: _straight(plans, transform))


class _Plan(NamedTuple):
  """One request of `_draws`: its key's four words (each shaped to
  broadcast over the blocks), its blocks' counter, the blocks' shape,
  whether a block's words go to four runs of rows, and the draw's shape."""
  key: list[jax.Array]
  counter: tuple
  blocks: tuple[int, ...]
  grouped: bool
  shape: tuple[int, ...]


def _plan(keys: jax.Array, shape) -> _Plan:
  data = jax.random.key_data(keys)
  batch, shape = data.shape[:-2], tuple(shape)
  grouped = len(shape) >= 2 and shape[-2] % 32 == 0
  blocks = (*shape[:-2], shape[-2] // 32, 8, shape[-1]) if grouped else shape
  data = data.reshape(*batch, 4)
  return _Plan(key=[data[..., i].reshape(*batch, *(1,) * len(blocks))
                    for i in range(4)],
               counter=(*_positions(blocks), 0, 0), blocks=(*batch, *blocks),
               grouped=grouped, shape=(*batch, *shape))


def _straight(plans: Sequence[_Plan], transform: Callable
              ) -> list[jax.Array]:
  """`_draws` as straight-line code per request, each word mapped on its
  own: the TPU compiler then writes values once, not the bits first. On a
  GPU the words pass a barrier: its compiler fuses a block's rounds into
  its words' consumers and computes blocks again (138.5 FLOPs a value
  against 100 at 12 x 768 x 3072)."""
  draws = []
  for plan in plans:
    words = threefry4x32(plan.key, plan.counter)
    if not plan.grouped:
      draws.append(transform(words[0]))
      continue
    words = jax.lax.platform_dependent(
        words, default=lambda w: w, cuda=jax.lax.optimization_barrier)
    values = jnp.stack([transform(w) for w in words], axis=-3)
    draws.append(values.reshape(plan.shape))
  return draws


# On CPUs, requests of at most this many blocks share one loop: a loop of
# its own costs XLA:CPU 0.2 s to compile, and 2^16 blocks about 2 ms to run
# (5.2M blocks ran in 170 ms); the shared loop also lays out each block's
# key, five words more.
_SHARED_LOOP_BLOCKS = 2**16


def _rolled(plans: Sequence[_Plan], transform: Callable) -> list[jax.Array]:
  """`_draws` in rolled loops: one for all requests of at most
  `_SHARED_LOOP_BLOCKS` blocks, laid end to end, and one for each larger
  request. XLA:CPU's compile time grows with the number of loops, not
  their length: a tree of seven small shapes compiled in 1.2 s against 2.0
  with a loop each. A block's four words are mapped at once: one transform
  to compile."""
  sizes = [math.prod(plan.blocks) for plan in plans]
  shared = [i for i, size in enumerate(sizes) if size <= _SHARED_LOOP_BLOCKS]
  words = {i: threefry4x32(plan.key, plan.counter, rolled=True)
           for i, plan in enumerate(plans) if sizes[i] > _SHARED_LOOP_BLOCKS}
  if shared:
    flat = lambda parts: jnp.concatenate(
        [jnp.broadcast_to(part, plans[i].blocks).ravel()
         for part, i in zip(parts, shared)])
    together = threefry4x32(
        [flat([plans[i].key[w] for i in shared]) for w in range(4)],
        [flat([plans[i].counter[w] for i in shared]) for w in range(2)]
        + [0, 0], rolled=True)
    start = 0
    for i in shared:
      end = start + sizes[i]
      words[i] = [w[start:end].reshape(plans[i].blocks) for w in together]
      start = end
  return [jnp.moveaxis(transform(jnp.stack(words[i])), 0, -3
                       ).reshape(plan.shape) if plan.grouped
          else transform(words[i][0]) for i, plan in enumerate(plans)]


def _draw(keys: jax.Array, shape, transform: Callable) -> jax.Array:
  """One request of `_draws`."""
  return _draws([(keys, shape)], transform)[0]


def _unit(bits: jax.Array, low: float, high: float = 1.0) -> jax.Array:
  """float32 in [low, high) from uint32 bits, as `jax.random.uniform`
  maps them."""
  mantissa = lax.shift_right_logical(bits, np.uint32(9))
  unit = lax.sub(lax.bitcast_convert_type(  # [0, 1)
      lax.bitwise_or(mantissa, np.uint32(0x3F800000)), jnp.float32),
                 np.float32(1.0))
  low, high = np.float32(low), np.float32(high)
  return lax.max(low, lax.add(lax.mul(unit, high - low), low))


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
  return _draw(keys, shape, _normal)


def _normal(bits):
  return np.float32(np.sqrt(2.0)) * lax.erf_inv(_unit(bits, _OPEN_BELOW))


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

  The leaves of one shape (and one `layouts` label) are drawn together,
  their pairs stacked: the same bits as a draw per leaf, but one hash for
  XLA to compile per group instead of one per leaf (a model's layers
  repeat a few shapes: the tests' tiny T5 has 47 leaves of 6 shapes, and
  its noise compiled in 2.6 s instead of 6.7 s, with other work running);
  on CPUs the small groups share one loop (`_draws`). On a mesh, pass
  `layouts`, a hashable label per leaf (its logical axes; a prefix tree of
  `tree`): leaves of one shape but different layouts (a layer's input and
  output projections) are then drawn apart, so each group's stacked draw
  can take its leaves' one layout instead of moving noise between devices.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  labels = ([None] * len(leaves) if layouts is None
            else treedef.flatten_up_to(layouts))
  # Leaf i's pair: split i of both keys.
  pairs = jax.vmap(lambda k: jax.random.split(k, len(leaves)), out_axes=1
                   )(keys)
  groups: dict[Any, list[int]] = {}
  for i, (leaf, label) in enumerate(zip(leaves, labels)):
    groups.setdefault((jnp.shape(leaf), label), []).append(i)
  draws = _draws([(pairs[np.asarray(members)], shape)
                  for (shape, _), members in groups.items()], _normal)
  noisy = [None] * len(leaves)
  for group, members in zip(draws, groups.values()):
    for draw, i in zip(group, members):
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
