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

`BandMF` is the mechanism (`train.mechanism = 'bandmf'`): its strategy is
chosen when the run is planned and kept in the plan, so a resumed run
uses the very same one.

Cost: b - 1 float32 copies of the trained params in memory (a frozen leaf,
e.g. of LoRA's base, keeps b - 1 numbers), and b - 1 multiply-adds per
trained parameter per step.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import errors
from dpjax.privacy import accounting, noise, optimizers, sampling
from dpjax.privacy.mechanisms import dpsgd

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
    """The number of bands b."""
    return len(self.coefs)

  def noising_matrix(self):
    """`C⁻¹` as jax-privacy's `StreamingMatrix`."""
    from jax_privacy.matrix_factorization import toeplitz
    return toeplitz.inverse_as_streaming_matrix(
        jnp.asarray(self.coefs, jnp.float32), column_normalize_for_n=self.steps)

  def matrix(self) -> np.ndarray:
    """`C` itself, float64[steps, steps]: jax-privacy's lower-triangular
    Toeplitz matrix of `coefs`, each column scaled to unit L2 norm as
    `noising_matrix` normalises it (`C` times the releases is the clipped
    sums' `C x` plus i.i.d. noise: what an audit decorrelates with)."""
    from jax_privacy.matrix_factorization import toeplitz
    c = np.asarray(toeplitz.materialize_lower_triangular(
        jnp.asarray(self.coefs, jnp.float32), self.steps), np.float64)
    return c / np.linalg.norm(c, axis=0)


@functools.lru_cache(maxsize=64)
def optimized_strategy(steps: int, bands: int) -> Strategy:
  """jax-privacy's banded Toeplitz strategy of `bands` bands that minimises
  the mean squared error of the prefix sums over `steps` steps (memoized:
  a pure function of the two, and an optimisation of seconds that every
  run planned with these steps would repeat)."""
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
                          trainable: Any = None, layouts: Any = None):
  """`(init, privatize)` for one clipped sum with BandMF noise.

  `init(params) -> state` (the streaming matrix's: a release counter and
  b - 1 float32 buffers per trained leaf; a frozen leaf, `trainable` False,
  b - 1 numbers); `privatize(sums, count, noise_secret, state)
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

  def privatize(sums, count, noise_secret, state):
    if len(sums) != 1:
      raise ValueError(f"BandMF noises one clipped sum, got {sorted(sums)}")
    (total,) = sums.values()
    fresh = noise.add_gaussian_noise(noise_shaped(total),
                                     noise.noise_key(noise_secret, count),
                                     stddev, layouts)
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


@dataclasses.dataclass(frozen=True)
class BandMF(dpsgd.DPSGD):
  """BandMF: b-banded correlated noise, cyclic Poisson sampling of
  examples, every step a DP step at one bound. `bands`: the setting
  (`train.bands`; None: the least expected error at the target); once
  resolved, `coefs` is the strategy and `candidates` the bands compared."""
  name: ClassVar[str] = "bandmf"
  record_key: ClassVar[str] = "bandmf"
  setting: ClassVar[str] = ("train.mechanism = 'bandmf' (cyclic Poisson "
                            "sampling of examples, every step a DP step at "
                            "one bound)")

  bands: int | None = None
  coefs: tuple[float, ...] | None = None
  # What the choice of bands compared: said, not part of the mechanism (so
  # it is left out of equality and the hash, which memoize its steps).
  candidates: tuple[dict, ...] = dataclasses.field(default=(), compare=False)
  steps: int | None = None  # the releases the strategy is normalised for

  @classmethod
  def from_config(cls, config) -> BandMF:
    bands = config.bands
    if bands is not None and (not errors.is_int(bands) or bands < 1):
      raise errors.UsageError("train.bands must be a positive integer or "
                               f"None, got {bands!r}")
    clashes = {
        "train.sampling_method = 'shuffle'":
            config.sampling_method != "poisson",
        "a redaction schedule": config.redaction_schedule is not None}
    for what, clash in clashes.items():
      if clash:
        raise errors.UsageError(f"{cls.setting} does not combine with {what}")
    return cls("poisson", bands)

  @classmethod
  def from_plan(cls, plan) -> BandMF:
    record = plan["bandmf"]
    return cls("poisson", int(record["bands"]), tuple(record["coefs"]),
               tuple(record.get("candidates", ())), int(plan["steps"]))

  def resolve(self, inputs: dpsgd.PlanInputs) -> BandMF:
    """The checkpoint's strategy on resume; else jax-privacy's optimised
    strategy of `bands` bands or, by default, of the band count whose
    error at the σ calibrated for the target (cyclic Poisson, cycle =
    bands) is least."""
    saved = (inputs.saved_plan or {}).get("bandmf")
    if saved:
      return dataclasses.replace(self.from_plan(inputs.saved_plan),
                                 steps=inputs.steps)
    steps, n, batch = inputs.steps, inputs.n, inputs.batch_size
    if self.bands is not None and self.bands > max_bands(steps, n, batch):
      raise errors.UsageError(
          f"train.bands = {self.bands}: each example must be eligible only "
          f"every bands-th step, so bands <= min(n // BATCH_SIZE = "
          f"{n // batch}, steps = {steps})")
    if self.bands is not None:
      strategy = optimized_strategy(steps, self.bands)
      return dataclasses.replace(self, coefs=strategy.coefs, steps=steps,
                                 candidates=({"bands": strategy.bands},))
    if math.isinf(inputs.target_epsilon) or inputs.noise_multiplier is not None:
      raise errors.UsageError(
          "train.mechanism = 'bandmf' chooses its bands at the σ calibrated "
          "for a finite TARGET_EPSILON: with train.noise_multiplier or ε = "
          "inf, set train.bands")

    def noise_multiplier(bands: int) -> float:
      return accounting.calibrate(
          inputs.target_epsilon, inputs.delta, self._scheme(n, batch, bands),
          [steps], accountant=inputs.accountant,
          prior_events=inputs.prior_events)

    strategy, _, rows = choose_bands(
        steps, band_candidates(steps, n, batch), noise_multiplier)
    return dataclasses.replace(self, bands=strategy.bands, steps=steps,
                               coefs=strategy.coefs, candidates=tuple(rows))

  @property
  def strategy(self) -> Strategy:
    """The resolved strategy: `coefs`, normalised for `steps` releases."""
    return Strategy(tuple(self.coefs), self.steps)

  def sampler(self, inputs, *, seed, unit_ids=None):
    return sampling.CyclicPoissonSampler(
        inputs.n, inputs.batch_size, cycle_length=self.bands,
        steps=inputs.steps, seed=seed,
        overflow_probability=inputs.overflow_probability)

  @staticmethod
  def _scheme(n: int, batch_size: int, bands: int) -> sampling.PoissonScheme:
    return sampling.PoissonScheme(batch_size / (n // bands),
                                  cycle_length=bands)

  def scheme(self, n, batch_size):
    return self._scheme(n, batch_size, self.bands)

  def record(self) -> dict:
    return {"bands": self.bands, "coefs": list(self.coefs),
            "candidates": [dict(r) for r in self.candidates]}

  def ledger_entry(self) -> dict:
    return {"name": self.name, "bands": self.bands}

  def note(self) -> str | None:
    if len(self.candidates) < 2:
      return None
    return ("BandMF bands (σ calibrated for the target, expected error σ x "
            "prefix error): " + ", ".join(
                f"{r['bands']}: σ={r['noise_multiplier']:.4f} "
                f"error={r['error']:.4g}" for r in self.candidates))

  def describe_noise(self) -> str:
    return (f"BandMF ({self.bands}-banded correlated noise, cyclic Poisson "
            "sampling)")

  def describe_sampling(self, sampler, n, batch_size) -> str:
    return (f"cyclic Poisson sampling (q={sampler.sampling_rate:.4g} of "
            f"n // {self.bands})")

  def privatizer(self, *, sensitivities, noise_multiplier, normalizer,
                 trainable=None, layouts=None) -> optimizers.Privatizer:
    if len(sensitivities) != 1:
      raise errors.UsageError(
          "train.mechanism = 'bandmf' noises one loss at a fixed clip norm: "
          "not a model with several losses")
    (sensitivity,) = sensitivities.values()
    init, privatize = correlated_privatizer(
        self.strategy, noise_multiplier=noise_multiplier,
        sensitivity=sensitivity, normalizer=normalizer, trainable=trainable,
        layouts=layouts)

    def update(sums, clip_norms, noise_state, count, noise_secret):
      release, noise_state = privatize(sums, count, noise_secret,
                                       noise_state)
      return release, clip_norms, noise_state

    return optimizers.Privatizer(lambda params: (None, init(params)), update,
                                 state_shardings)
