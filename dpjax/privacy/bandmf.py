"""BandMF: DP training with banded correlated noise (DP-MF / DP-FTRL).

`train.mechanism = 'bandmf'` replaces DP-SGD's independent noise by
correlated noise `C⁻¹ z`: a b-banded lower-triangular Toeplitz strategy
`C`, column-normalised for the run's T steps, whose inverse turns the
step's fresh Gaussian `z_t` into noise that mostly cancels in the sum of
updates (Choquette-Choo et al., "Amplified Banded Matrix Factorization: A
unified approach to private training", NeurIPS 2023). The strategy, its
inverse as a streaming matrix and the cyclic Poisson sampling its
amplification needs are jax-privacy's (`matrix_factorization.toeplitz`,
`batch_selection.CyclicPoissonSampling`); this module only chooses the
number of bands, and keys `z` with the run's secret as every dpjax release.

Formal guarantees
-----------------
`correlated_privatizer(strategy, ...)` adds, at release t, row t of
`C⁻¹ Z` to the clipped sum, where the rows `z_t` of `Z` are independent
`N(0, σ² C_clip² I)` keyed by `noise.noise_key(secret, t)` (never a seed
that ships with the code). `C` is b-banded with unit-norm columns; with
`sampling.CyclicPoissonSampler` at cycle length b each example takes part
at most once in every round of b steps (b-min-separation), so by Theorem 4
of the paper the T releases are as private as ⌈T/b⌉ rounds of DP-SGD: one
Poisson subsampled Gaussian of rate q and multiplier σ per round
(`sampling.PoissonScheme` with `cycle_length` b), which is what the ledger
records and jax-privacy's `DpsgdTrainingAccountant(cycle_length=b)`
computes.

The state carried from step to step (the b - 1 last rows of `C⁻¹ Z`) is
the noise itself: it is in the checkpoint, so a resumed run is
bit-identical, and it must stay as secret as the run's secret key.
`dpjax.export` writes params only.

Cost: b - 1 float32 copies of the trained params in memory (a frozen leaf,
e.g. of LoRA's base, keeps b - 1 numbers), and b - 1 multiply-adds per
trained parameter per step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import noise

MECHANISMS = ("dpsgd", "bandmf")
# Bands considered by `choose_bands`: powers of two, as the paper's sweeps.
MAX_BANDS = 64


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A banded Toeplitz strategy: `coefs` (L2 norm 1, one per band) of `C`,
  column-normalised for `steps` releases."""
  coefs: tuple[float, ...]
  steps: int

  @property
  def bands(self) -> int:
    return len(self.coefs)

  def noising_matrix(self):
    """`C⁻¹` as jax-privacy's `StreamingMatrix`."""
    from jax_privacy.matrix_factorization import toeplitz
    return toeplitz.inverse_as_streaming_matrix(
        jnp.asarray(self.coefs, jnp.float32), column_normalize_for_n=self.steps)


def optimized_strategy(steps: int, bands: int) -> Strategy:
  """jax-privacy's banded Toeplitz strategy of `bands` bands that minimises
  the mean squared error of the prefix sums over `steps` steps."""
  from jax_privacy.matrix_factorization import toeplitz
  coefs = toeplitz.optimize_banded_toeplitz(n=steps, bands=bands)
  return Strategy(tuple(float(c) for c in np.asarray(coefs)), steps)


def prefix_error(strategy: Strategy) -> float:
  """The strategy's root-mean-squared error of the prefix sums at unit
  noise (jax-privacy's `toeplitz.loss`)."""
  from jax_privacy.matrix_factorization import toeplitz
  return math.sqrt(float(toeplitz.loss(
      jnp.asarray(strategy.coefs, jnp.float32), n=strategy.steps)))


def max_bands(steps: int, dataset_size: int, batch_size: int) -> int:
  """The most bands b-min-separation allows: b <= T, and b <= N // B (each
  of the b groups must hold a batch)."""
  return min(steps, dataset_size // batch_size)


def band_candidates(steps: int, dataset_size: int,
                    batch_size: int) -> list[int]:
  """Powers of two up to `MAX_BANDS` and `max_bands`."""
  limit = min(max_bands(steps, dataset_size, batch_size), MAX_BANDS)
  return [2 ** k for k in range(int(math.log2(max(limit, 1))) + 1)]


def choose_bands(steps: int, candidates: Sequence[int],
                 noise_multiplier: Callable[[int], float]
                 ) -> tuple[Strategy, float, list[dict]]:
  """The strategy and σ of least expected error at the privacy target.

  For each candidate b: jax-privacy's optimised b-banded strategy and
  `noise_multiplier(b)`, the σ that meets the target under cyclic Poisson
  sampling with cycle b (fewer rounds but a higher rate as b grows); the
  error is σ times the strategy's prefix-sum error (b = 1 is DP-SGD).
  Returns (strategy, σ, one row per candidate)."""
  rows, best = [], None
  for b in candidates:
    strategy = optimized_strategy(steps, b)
    sigma = noise_multiplier(b)
    error = sigma * prefix_error(strategy)
    rows.append({"bands": b, "noise_multiplier": sigma, "error": error})
    if best is None or error < best[2]:
      best = (strategy, sigma, error)
  return best[0], best[1], rows


def correlated_privatizer(strategy: Strategy, *, noise_multiplier: float,
                          sensitivity: float, normalizer: float,
                          trainable: Any = None):
  """`(init, privatize)` for one clipped sum with BandMF noise.

  `init(params) -> state` (the streaming matrix's: a release counter and
  b - 1 float32 buffers per trained leaf; a frozen leaf, `trainable` False,
  b - 1 numbers); `privatize(sums, count, noise_secret, scales, state)
  -> (update, state)`: `sums` is `{name: clipped sum}` with one name; the
  update is `(sum + row count of C⁻¹ Z) / normalizer`, the frozen leaves
  exactly their zero sum. See the module docstring for the guarantee."""
  matrix = strategy.noising_matrix()
  stddev = noise_multiplier * sensitivity

  def trained(tree):
    return (jax.tree.map(lambda _: True, tree) if trainable is None
            else trainable)

  def noise_shaped(tree):
    """Zeros like the trained leaves; a scalar for a frozen one (it keeps
    its place, so every leaf's key stays the one it would have, and a
    checkpoint cannot hold an empty array)."""
    return jax.tree.map(
        lambda x, t: jnp.zeros(jnp.shape(x) if t else (), jnp.float32),
        tree, trained(tree))

  def init(params):
    return matrix.init_multiply(noise_shaped(params))

  def privatize(sums, count, noise_secret, scales, state):
    if len(sums) != 1 or scales is not None:
      raise ValueError("BandMF noises one clipped sum at a fixed bound, got "
                       f"{sorted(sums)} (scales {scales is not None})")
    (total,) = sums.values()
    fresh = noise.add_gaussian_noise(noise_shaped(total),
                                     noise.noise_key(noise_secret, count),
                                     stddev)
    correlated, state = matrix.multiply_next(fresh, state)
    noisy = jax.tree.map(
        lambda s, z, t: s.astype(jnp.float32) + z if t
        else s.astype(jnp.float32), total, correlated, trained(total))
    return jax.tree.map(lambda x: x / normalizer, noisy), state

  return init, privatize


def state_shardings(state: Any, param_shardings: Any, replicated) -> Any:
  """Shardings of a `correlated_privatizer` state: each part is a
  params-shaped tree; a leaf with the band axis in front is laid out like
  its parameter behind it, a counter is replicated."""

  def part(tree):
    def leaf(sharding, x):
      if jnp.ndim(x) <= 1:  # a counter; the buffer of a scalar (frozen leaf)
        return replicated
      spec = jax.sharding.PartitionSpec(None, *sharding.spec)
      return jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.tree.map(leaf, param_shardings, tree)

  return tuple(part(p) for p in state)
