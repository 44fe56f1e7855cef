"""Gradient canaries: Dirac directions in parameter space, each included in
the run by a secret fair coin, that enter the clipped sums of the steps
that sample them, and the release observed at their coordinates.

A canary is one coordinate of the trained parameters. Its gradient is
`RAW_NORM_FACTOR` times the release's bound along that coordinate, so it
is clipped like any unit's (`clipped_norm`): it adds exactly the bound (the
sum's sensitivity) to the clipped sum of every DP step that samples it, and
nothing to any other coordinate. As many control coordinates, which no
canary touches, show the noise (and the real examples' gradients) of the
same release. `audited(privatizer, ...)` wraps a mechanism's privatizer:
before the release the included, sampled canaries are added to the sums;
after it the release at the 2m coordinates is kept in the noise state, from
which `Recorder` copies it to the host after each DP step.

Formal guarantees
-----------------
The canaries are the privacy units of an auditing experiment (Steinke,
Nasr and Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS
2023, arXiv 2305.08846): each is included with probability 1/2,
independently, by a coin drawn from the run's secret noise key (stream
`CANARY_STREAM`, apart from the noise's), and an included canary is
sampled at each step as the data's sampling samples a unit (Poisson at the
sampler's true rate, in its group's steps only under cyclic Poisson, or
once per epoch for shuffling), from the same secret. A canary's contribution is a clipped unit's, so the run's guarantee
holds for each canary exactly as for each example: that is what the audit
tests. The sampling, clipping, noise and accounting of the real examples
are unchanged; the canaries change the release by at most the bound per
sampled canary. The coordinates are public (chosen by the run's public
`seed`): an adversary designs its canaries; the coins and the sampling are
not, and the scores (`dpjax.audit.scores`) never read them.

Costs and limits: the insertion and the observation are a scatter-add and
a gather over the 2m coordinates per step (on a mesh, a leaf holding
canaries is gathered to do so: an audit run is small). A sampler other than
Poisson (of examples or users), cyclic Poisson (BandMF) or shuffling is
refused (`participation`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import errors
from dpjax.privacy import noise, optimizers, sampling
from dpjax.privacy.mechanisms import multi_loss

CANARY_STREAM = 0x63616E61  # "cana": the coins' and canary sampling's keys
_COINS, _POISSON, _SHUFFLE, _CYCLE = 0, 1, 2, 3
# A canary's gradient before clipping, in units of the bound: over it, so a
# release that skipped clipping would carry more than the bound.
RAW_NORM_FACTOR = 4.0


def clipped_norm(raw_norm, bound):
  """The norm of a gradient of norm `raw_norm` clipped to `bound`."""
  return jnp.minimum(raw_norm, bound)


@dataclasses.dataclass(frozen=True)
class Participation:
  """How the data's sampling samples one unit: Poisson at `rate` per step
  (with `cycle_length` b, cyclic Poisson: the unit's uniform group g, and
  Poisson at `rate` in the steps t ≡ g mod b only), or (`steps_per_epoch`
  set) once per epoch at a uniform step of it."""
  rate: float | None = None
  steps_per_epoch: int | None = None
  cycle_length: int = 1


def participation(sampler) -> Participation:
  """The sampling of `sampler`, for a canary; UsageError for a sampler the
  audit does not model."""
  if isinstance(sampler, sampling.ShuffleSampler):
    return Participation(steps_per_epoch=sampler.steps_per_epoch)
  if isinstance(sampler, sampling.CyclicPoissonSampler):
    return Participation(rate=sampler.sampling_rate,
                         cycle_length=sampler.cycle_length)
  if isinstance(sampler, (sampling.PoissonSampler,
                          sampling.UserPoissonSampler)):
    return Participation(rate=sampler.sampling_rate)
  raise errors.UsageError(
      f"the gradient audit models Poisson, cyclic Poisson and shuffle "
      f"sampling; this run's {type(sampler).__name__} is not modelled")


def coins(noise_secret, count: int) -> jax.Array:
  """bool[count]: which of an audit run's `count` canaries it includes,
  from the run's secret alone (what a release's check of the audit
  recomputes)."""
  keys = noise.stream_keys(noise_secret, CANARY_STREAM, _COINS)
  return noise.uniform(keys, (count,), 0.0) < 0.5


@dataclasses.dataclass(frozen=True, eq=False)
class GradientCanaries:
  """m canaries and m controls at distinct coordinates of the params.

  `leaves[j]`: the flat indices, in leaf j (tree order) of the params, of
  the coordinates it holds, and `which[j]` their positions among the 2m
  (canaries first, then controls). `losses[i]`: the release canary i
  enters (round robin over the model's named losses)."""
  count: int
  leaves: Mapping[int, np.ndarray]
  which: Mapping[int, np.ndarray]
  losses: tuple[str, ...]
  participation: Participation

  def coins(self, noise_secret) -> jax.Array:
    """bool[m]: which canaries the run includes (secret)."""
    return coins(noise_secret, self.count)

  def sampled(self, noise_secret, count) -> jax.Array:
    """bool[m]: the canaries DP step `count` samples, if included."""
    p = self.participation
    if p.steps_per_epoch:
      keys = noise.stream_keys(noise_secret, CANARY_STREAM, _SHUFFLE,
                               count // p.steps_per_epoch)
      slot = jnp.floor(noise.uniform(keys, (self.count,), 0.0)
                       * p.steps_per_epoch).astype(jnp.int32)
      return slot == count % p.steps_per_epoch
    keys = noise.stream_keys(noise_secret, CANARY_STREAM, _POISSON, count)
    drawn = noise.uniform(keys, (self.count,), 0.0) < p.rate
    if p.cycle_length == 1:
      return drawn
    return drawn & (self.groups_of_cycle(noise_secret)
                    == count % p.cycle_length)

  def groups_of_cycle(self, noise_secret) -> jax.Array:
    """int32[m]: each canary's group of cyclic Poisson sampling (secret,
    uniform over the cycle, fixed for the run)."""
    keys = noise.stream_keys(noise_secret, CANARY_STREAM, _CYCLE)
    return jnp.floor(noise.uniform(keys, (self.count,), 0.0)
                     * self.participation.cycle_length).astype(jnp.int32)

  def insert(self, sums: Mapping[str, Any], bounds: Mapping[str, float],
             count, noise_secret) -> dict:
    """`sums` with each included canary that step `count` samples added
    along its coordinate, clipped to its release's bound."""
    present = self.coins(noise_secret) & self.sampled(noise_secret, count)
    out = dict(sums)
    for name in dict.fromkeys(self.losses):
      leaves, treedef = jax.tree_util.tree_flatten(out[name])
      magnitude = clipped_norm(RAW_NORM_FACTOR * bounds[name], bounds[name])
      for j, flat in self.leaves.items():
        ids = self.which[j]
        mine = ids < self.count  # canaries, not controls ...
        mine[mine] = np.asarray(self.losses)[ids[mine]] == name  # ... of name
        if not mine.any():
          continue
        add = magnitude * present[ids[mine]].astype(jnp.float32)
        leaf = leaves[j]
        leaves[j] = leaf.reshape(-1).at[flat[mine]].add(
            add.astype(leaf.dtype)).reshape(leaf.shape)
      out[name] = jax.tree_util.tree_unflatten(treedef, leaves)
    return out

  def groups(self) -> np.ndarray:
    """int[2m]: the params leaf (tree order) of each coordinate."""
    out = np.empty(2 * self.count, np.int64)
    for j, at in self.which.items():
      out[at] = j
    return out

  def observe(self, release) -> jax.Array:
    """float32[2m]: the release at the canaries' then the controls'
    coordinates."""
    leaves = jax.tree_util.tree_leaves(release)
    out = jnp.zeros((2 * self.count,), jnp.float32)
    for j, flat in self.leaves.items():
      out = out.at[self.which[j]].set(
          leaves[j].reshape(-1)[flat].astype(jnp.float32))
    return out


def trained_coordinates(model) -> int:
  """How many float coordinates `model` trains (LoRA: its adapters')."""
  return int(_trained_sizes(model).sum())


def _trained_sizes(model) -> np.ndarray:
  """int64[leaves]: each params leaf's trained float coordinates."""
  leaves = jax.tree_util.tree_leaves(model.abstract_params()[0])
  trainable = multi_loss.trainable_mask(model)
  masks = ([True] * len(leaves) if trainable is None
           else jax.tree_util.tree_leaves(trainable))
  return np.array([int(np.prod(x.shape)) if t and jnp.issubdtype(
      x.dtype, jnp.floating) else 0 for x, t in zip(leaves, masks)], np.int64)


@functools.lru_cache(maxsize=8)
def choose(model, count: int, participation_: Participation,
           seed: int) -> GradientCanaries:
  """`count` canaries and `count` controls at distinct coordinates of
  `model`'s trained float leaves, uniformly (public `seed`); UsageError if
  they have fewer than 2 * count coordinates. The same object for the same
  arguments (the model memoized, `trainable.trainable`), so a second audit
  of the same run places no new steps."""
  losses = multi_loss.release_names(model)
  sizes = _trained_sizes(model)
  total = int(sizes.sum())
  if 2 * count > total:
    raise errors.UsageError(
        f"--canaries={count}: the audit needs 2 × {count} trained "
        f"coordinates (canaries and controls); the model trains {total}")
  rng = np.random.default_rng([seed, CANARY_STREAM])
  picked = rng.choice(total, size=2 * count, replace=False)
  starts = np.cumsum(sizes) - sizes
  leaf_of = np.searchsorted(starts, picked, side="right") - 1
  flat, which = {}, {}
  for j in np.unique(leaf_of):
    at = np.flatnonzero(leaf_of == j)
    flat[int(j)] = picked[at] - starts[j]
    which[int(j)] = at
  return GradientCanaries(
      count, flat, which,
      tuple(losses[i % len(losses)] for i in range(count)), participation_)


def audited(privatizer: optimizers.Privatizer, canaries: GradientCanaries,
            sensitivities: Mapping[str, float]) -> optimizers.Privatizer:
  """`privatizer` whose releases carry the canaries, and whose noise state
  is `(its own, the last release at the 2m coordinates)`."""

  def init(params):
    clip_norms, inner = privatizer.init(params)
    return clip_norms, (inner, jnp.zeros((2 * canaries.count,), jnp.float32))

  def update(sums, clip_norms, noise_state, count, noise_secret):
    inner, _ = noise_state
    sums = canaries.insert(sums, sensitivities, count, noise_secret)
    release, clip_norms, inner = privatizer.update(
        sums, clip_norms, inner, count, noise_secret)
    return release, clip_norms, (inner, canaries.observe(release))

  def shardings(noise_state, params_sh, replicated):
    inner = noise_state[0]
    inner_sh = (None if inner is None else
                privatizer.noise_state_shardings(inner, params_sh, replicated))
    return inner_sh, replicated

  return optimizers.Privatizer(init, update, shardings)


class Recorder:
  """A `loop.fit` callback: after each DP step, the release at the canary
  and control coordinates (`observations()`: float32[steps, 2m])."""

  def __init__(self):
    self.rows: list[np.ndarray] = []

  def __call__(self, step: int, state, output, final: bool):
    del step, final
    if output.dp:
      self.rows.append(np.asarray(jax.device_get(state.noise_state[1])))

  def observations(self) -> np.ndarray:
    return np.stack(self.rows)
