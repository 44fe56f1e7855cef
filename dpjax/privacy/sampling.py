"""Batch selection for DP training: Poisson sampling and shuffling.

Samplers are host-side and stateless in the step: `indices(step)` depends only
on `(seed, step)`, so every host computes the same batch and a run resumes from
any step without replaying earlier ones. Their `describe()` dict is what the
privacy ledger records as the sampling scheme; their `scheme` is what the
accountant needs of them: the neighbouring relation the guarantee is stated
for, the unit of privacy, and the accounting events of a run of steps
(`scheme_from_description` rebuilds it from a ledger's record).

Formal guarantees
-----------------
* `PoissonSampler`: at every step each of the `N` examples is included
  independently with probability `q`, independently across steps; no sampled
  example is ever dropped (see the overflow policy). Together with a clipped
  sum of sensitivity `C` and noise `sigma C`, each step is the Poisson
  subsampled Gaussian mechanism under add-or-remove-one adjacency, accounted
  by `accounting.PoissonGaussian`.
* `UserPoissonSampler`: the same at the level of users: each of the `U`
  users is included independently with probability `q`, and a sampled user
  contributes at most `k` of their examples (a uniformly random subset,
  drawn afresh each step), each weighted `1/c` where `c <= k` is how many
  were taken. The clipped sum weights each example's clipped gradient (see
  `clipping`), so one user moves it by at most `C` in L2 norm: each step is
  the Poisson subsampled Gaussian mechanism under add-or-remove-one-USER
  adjacency, accounted as `PoissonGaussian` at the user rate, with `n = U`.
* `ShuffleSampler`: each epoch is a fresh data-independent permutation cut
  into fixed-size batches, so each example is in at most one batch per epoch.
  Under replace-one adjacency one batch sum changes by at most `2C` and the
  others not at all, so an epoch is (adaptively composed) ONE Gaussian
  mechanism with effective noise multiplier `sigma / 2`; no amplification by
  shuffling is claimed. Epochs compose; a partial epoch counts as a full one.
  Accounted by `accounting.shuffle_epochs_event`.

Poisson amplification assumes the adversary never learns which examples (or
users) were sampled: the seed must be secret (the trainer passes the run
secret's `RunSecret.sampling_seed()`, 256 bits of OS entropy, never
`train.seed`), and the indices and realised batch sizes must not be released.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import ClassVar, Sequence

import numpy as np
from scipy import stats

from dpjax.privacy import accounting

# Separate random streams for the samplers, so the same seed may be reused.
SAMPLER_STREAM = 0x73616D70  # "samp"
SHUFFLE_STREAM = 0x73687566  # "shuf"
USER_STREAM = 0x75736572  # "user"
CYCLIC_STREAM = 0x6379636C  # "cycl"


class Neighbouring(enum.Enum):
  """Which datasets are neighbours for the guarantee."""
  ADD_OR_REMOVE_ONE = "add_or_remove_one"
  REPLACE_ONE = "replace_one"


def _periods_begun(start: int, stop: int, period: int) -> int:
  """How many periods of `period` steps (epochs, rounds) begin within steps
  [start, stop): counting each at its first step counts a partial one in
  full, once, however a run is split."""
  if stop <= start:
    return 0
  return math.ceil(stop / period) - math.ceil(start / period)


@dataclasses.dataclass(frozen=True)
class PoissonScheme:
  """Poisson sampling at rate q: each DP step is one Poisson-subsampled
  Gaussian per release, under add-or-remove-one adjacency.

  `cycle_length` b > 1 is cyclic Poisson sampling (BandMF's,
  `CyclicPoissonSampler`): the data split into b groups, step t samples
  group t mod b at rate q. With a b-banded, column-normalised strategy
  each round of b steps is, for one example, one Poisson subsampled
  Gaussian (Theorem 4 of Choquette-Choo et al., NeurIPS 2023, "Amplified
  Banded Matrix Factorization"); b = 1 is plain Poisson sampling, a round
  per step."""
  sampling_rate: float
  unit: str = "example"
  cycle_length: int = 1
  neighbouring: ClassVar[Neighbouring] = Neighbouring.ADD_OR_REMOVE_ONE

  def events(self, noise_multipliers: Sequence[float], stop: int,
             start: int = 0) -> list[accounting.Event]:
    """The events of DP steps [start, stop): a round is counted at its
    first step, so a partial round counts in full and splitting a run into
    pieces never undercounts."""
    rounds = _periods_begun(start, stop, self.cycle_length)
    if not rounds:
      return []
    return [accounting.PoissonGaussian(self.sampling_rate,
                                       tuple(noise_multipliers), rounds)]


@dataclasses.dataclass(frozen=True)
class ShuffleScheme:
  """Shuffled epochs of `steps_per_epoch` batches: one Gaussian per epoch
  with noise multiplier σ/2 (`accounting.shuffle_epochs_event`), under
  replace-one adjacency."""
  steps_per_epoch: int
  unit: str = "example"
  neighbouring: ClassVar[Neighbouring] = Neighbouring.REPLACE_ONE

  def events(self, noise_multipliers: Sequence[float], stop: int,
             start: int = 0) -> list[accounting.Event]:
    """The events of DP steps [start, stop): an epoch is counted at its
    first step, so a partial epoch counts in full and splitting a run into
    pieces never undercounts."""
    epochs = _periods_begun(start, stop, self.steps_per_epoch)
    if not epochs:
      return []
    return [accounting.shuffle_epochs_event(
        accounting.effective_noise_multiplier(noise_multipliers), epochs)]


def scheme_from_description(description: dict) -> PoissonScheme | ShuffleScheme:
  """The scheme of a sampler's `describe()` record (a ledger's `sampling`)."""
  method = description.get("method")
  if method == "poisson":
    return PoissonScheme(description["sampling_rate"])
  if method == "user_poisson":
    return PoissonScheme(description["sampling_rate"], unit="user")
  if method == "cyclic_poisson":
    return PoissonScheme(description["sampling_rate"],
                         cycle_length=description["cycle_length"])
  if method == "shuffle":
    return ShuffleScheme(description["steps_per_epoch"])
  raise ValueError(f"Unknown sampling method {method!r}.")


def _pack(sample: np.ndarray, num_microbatches: int,
          microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Pads `sample` to [num_microbatches, microbatch_size] with a 0/1 mask."""
  idx = np.zeros(num_microbatches * microbatch_size, np.int64)
  mask = np.zeros(num_microbatches * microbatch_size, np.float32)
  idx[:sample.size] = sample
  mask[:sample.size] = 1.0
  shape = (num_microbatches, microbatch_size)
  return idx.reshape(shape), mask.reshape(shape)


def _check_microbatch_size(microbatch_size: int) -> None:
  if microbatch_size < 1:
    raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}.")


def _pack_poisson(sample: np.ndarray, max_batch_size: int,
                  microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """A Poisson sample in `ceil(max_batch_size / m)` microbatches, or more
  of the same shape if it is larger (the overflow policy: nothing dropped)."""
  _check_microbatch_size(microbatch_size)
  planned = math.ceil(max_batch_size / microbatch_size)
  needed = math.ceil(sample.size / microbatch_size)
  return _pack(sample, max(planned, needed), microbatch_size)


class PoissonSampler:
  """Poisson sampling: each example joins each batch independently w.p. `q`.

  Formal guarantees:
    `indices(step)` is an exact Poisson sample with rate `sampling_rate`,
    drawn from `np.random.default_rng([seed, step, SAMPLER_STREAM])` and so
    independent across steps and of the data.

    Overflow policy: `microbatches(step, m)` normally returns
    `K = ceil(max_batch_size / m)` microbatches, a fixed shape for compiled
    code. If a sample exceeds `K * m` examples (probability
    `<= overflow_probability` per step with the default `max_batch_size`), it
    returns MORE microbatches `K' = ceil(size / m)` of the same shape rather
    than truncating, and the trainer processes them all before the single
    noisy release. No sampled example is ever dropped, so the Poisson
    guarantee is exact; overflow only costs time.
  """

  def __init__(
      self,
      dataset_size: int,
      expected_batch_size: float | None = None,
      *,
      sampling_rate: float | None = None,
      seed: int,
      max_batch_size: int | None = None,
      overflow_probability: float = 1e-6,
  ):
    """Initializes the sampler.

    Args:
      dataset_size: Number of examples `N`.
      expected_batch_size: `q * N`; give this or `sampling_rate`.
      sampling_rate: `q` in (0, 1]; give this or `expected_batch_size`.
      seed: Sampling seed.
      max_batch_size: Size the compiled batch shape is planned for. Defaults
        to the smallest `m` with `P(Binomial(N, q) > m) <= overflow_probability`.
      overflow_probability: Target per-step overflow probability for the
        default `max_batch_size`.
    """
    if dataset_size < 1:
      raise ValueError(f"dataset_size must be >= 1, got {dataset_size}.")
    if (expected_batch_size is None) == (sampling_rate is None):
      raise ValueError(
          "Give exactly one of expected_batch_size and sampling_rate.")
    if sampling_rate is None:
      sampling_rate = expected_batch_size / dataset_size
    if not 0 < sampling_rate <= 1:
      raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")
    if not 0 < overflow_probability < 1:
      raise ValueError("overflow_probability must be in (0, 1), got "
                       f"{overflow_probability}.")
    self.dataset_size = int(dataset_size)
    self.sampling_rate = float(sampling_rate)
    self.seed = int(seed)
    if max_batch_size is None:
      max_batch_size = self._quantile(overflow_probability)
    if max_batch_size < 1:
      raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
    self.max_batch_size = int(max_batch_size)

  def _quantile(self, overflow_probability: float) -> int:
    """Smallest m with P(Binomial(N, q) > m) <= overflow_probability."""
    n, q = self.dataset_size, self.sampling_rate
    m = int(stats.binom.isf(overflow_probability, n, q))
    # isf works in floating point; step to the exact smallest such m.
    while m < n and stats.binom.sf(m, n, q) > overflow_probability:
      m += 1
    while m > 0 and stats.binom.sf(m - 1, n, q) <= overflow_probability:
      m -= 1
    return max(m, 1)

  @property
  def expected_batch_size(self) -> float:
    """The expected examples per step: `q * N`."""
    return self.sampling_rate * self.dataset_size

  def steps_per_epoch(self) -> float:
    """Expected steps for one pass over the data: `1 / q`."""
    return 1.0 / self.sampling_rate

  def indices(self, step: int) -> np.ndarray:
    """Sorted int64 indices of the Poisson sample at `step`."""
    rng = np.random.default_rng([self.seed, step, SAMPLER_STREAM])
    # Size ~ Binomial(N, q) then a uniform subset of that size is exactly a
    # Poisson sample, in O(size) rather than O(N) random draws.
    size = rng.binomial(self.dataset_size, self.sampling_rate)
    sample = rng.choice(self.dataset_size, size=size, replace=False)
    return np.sort(sample).astype(np.int64)

  def microbatches(self, step: int,
                   microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(idx [K, m] int64, mask [K, m] float32)` covering the whole sample.

    Padding slots hold index 0 with mask 0. `K = ceil(max_batch_size / m)`
    unless the sample is larger, in which case more microbatches are returned
    (see the class overflow policy).
    """
    return _pack_poisson(self.indices(step), self.max_batch_size,
                         microbatch_size)

  @property
  def scheme(self) -> PoissonScheme:
    """The accounting: Poisson sampling at `sampling_rate`."""
    return PoissonScheme(self.sampling_rate)

  def describe(self) -> dict:
    """The sampling as the privacy ledger records it (JSON)."""
    return {
        "method": "poisson",
        "sampling_rate": self.sampling_rate,
        "dataset_size": self.dataset_size,
        "expected_batch_size": self.expected_batch_size,
        "max_batch_size": self.max_batch_size,
        "adjacency": self.scheme.neighbouring.value,
        "overflow_policy": (
            "extra microbatches of the same shape; no example is dropped, so "
            "Poisson accounting is exact"),
    }


class UserPoissonSampler:
  """Poisson sampling of users, at most `k` examples from each sampled user.

  Formal guarantees:
    `sample(step)` includes each of the `U` users independently with
    probability `sampling_rate`, drawn from
    `np.random.default_rng([seed, step, USER_STREAM])` and so independent
    across steps and of the data. From a sampled user with `n_u` examples it
    takes `c_u = min(n_u, k)` of them, a uniformly random subset, each with
    weight `1 / c_u`: a user's weights sum to 1, so with per-example clipping
    at `C` (weights applied after clipping, `clipping.clip_scales`) one
    user's contribution to the sum has L2 norm `<= C`: the average of their
    clipped gradients. Adding or removing one user (all their examples)
    moves the sum by at most `C`: a step is the Poisson subsampled Gaussian
    at the user rate, with `U` as the dataset size (δ, the ledger's `n`).

    The overflow policy is `PoissonSampler`'s: `max_batch_size` (in
    examples) is planned from a normal approximation to the sample's size,
    and a larger sample gets more microbatches; nothing sampled is dropped.
  """

  def __init__(self, user_ids, expected_users: float, *, seed: int,
               max_examples_per_user: int,
               overflow_probability: float = 1e-6):
    """Initializes the sampler.

    Args:
      user_ids: [N] each example's user (any hashable numpy values).
      expected_users: `q * U`, the expected sampled users per step.
      seed: Sampling seed (secret).
      max_examples_per_user: `k >= 1`.
      overflow_probability: Target per-step overflow probability of the
        planned batch shape (approximate; overflow only costs time).
    """
    user_ids = np.asarray(user_ids)
    if user_ids.ndim != 1 or user_ids.size < 1:
      raise ValueError("user_ids must be a non-empty 1-D array, got shape "
                       f"{user_ids.shape}.")
    if max_examples_per_user < 1:
      raise ValueError("max_examples_per_user must be >= 1, got "
                       f"{max_examples_per_user}.")
    _, users = np.unique(user_ids, return_inverse=True)
    self.num_examples = int(user_ids.size)
    self.dataset_size = int(users.max()) + 1  # U: the units of privacy
    if not 0 < expected_users <= self.dataset_size:
      raise ValueError(f"expected_users must be in (0, U={self.dataset_size}]"
                       f", got {expected_users}.")
    if not 0 < overflow_probability < 1:
      raise ValueError("overflow_probability must be in (0, 1), got "
                       f"{overflow_probability}.")
    self.sampling_rate = float(expected_users) / self.dataset_size
    self.seed = int(seed)
    self.max_examples_per_user = int(max_examples_per_user)
    # Each user's examples, contiguous: _order[_starts[u]:_starts[u] + n_u].
    self._order = np.argsort(users, kind="stable").astype(np.int64)
    self._counts = np.bincount(users, minlength=self.dataset_size)
    self._starts = np.cumsum(self._counts) - self._counts
    taken = np.minimum(self._counts, self.max_examples_per_user)
    q = self.sampling_rate
    mean = q * taken.sum()
    std = math.sqrt(q * (1 - q) * np.square(taken.astype(float)).sum())
    planned = math.ceil(mean + stats.norm.isf(overflow_probability) * std)
    self.max_batch_size = int(min(max(planned, 1), taken.sum()))

  @property
  def expected_batch_size(self) -> float:
    """The expected sampled users, `q * U` (the noisy sum's normaliser)."""
    return self.sampling_rate * self.dataset_size

  def sample(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """`(indices [s] int64, weights [s] float32)` of step `step`: the
    sampled users' chosen examples, each weighted 1 / (its user's count)."""
    rng = np.random.default_rng([self.seed, step, USER_STREAM])
    size = rng.binomial(self.dataset_size, self.sampling_rate)
    users = np.sort(rng.choice(self.dataset_size, size=size, replace=False))
    counts = self._counts[users]
    group = np.repeat(np.arange(users.size), counts)
    group_start = np.repeat(np.cumsum(counts) - counts, counts)
    position = np.arange(group.size) - group_start
    examples = self._order[np.repeat(self._starts[users], counts) + position]
    # A uniform subset of each user's examples: rank them by random keys
    # within their group and keep the first k.
    by_key = np.lexsort((rng.random(group.size), group))
    keep = by_key[position < self.max_examples_per_user]
    taken = np.minimum(counts, self.max_examples_per_user)
    chosen, weights = examples[keep], 1.0 / taken[group[keep]]
    order = np.argsort(chosen)
    return chosen[order], weights[order].astype(np.float32)

  def indices(self, step: int) -> np.ndarray:
    """Sorted int64 example indices of step `step`'s sample."""
    return self.sample(step)[0]

  def microbatches(self, step: int,
                   microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(idx [K, m] int64, weights [K, m] float32)`: `PoissonSampler`'s
    shapes, the mask holding each example's weight (0 for padding)."""
    sample, weights = self.sample(step)
    idx, mask = _pack_poisson(sample, self.max_batch_size, microbatch_size)
    mask[mask > 0] = weights
    return idx, mask

  @property
  def scheme(self) -> PoissonScheme:
    """The accounting: Poisson sampling of users at `sampling_rate`."""
    return PoissonScheme(self.sampling_rate, unit="user")

  def describe(self) -> dict:
    """The sampling as the privacy ledger records it (JSON)."""
    return {
        "method": "user_poisson",
        "unit": "user",
        "sampling_rate": self.sampling_rate,
        "dataset_size": self.dataset_size,
        "num_examples": self.num_examples,
        "max_examples_per_user": self.max_examples_per_user,
        "expected_batch_size": self.expected_batch_size,
        "max_batch_size": self.max_batch_size,
        "adjacency": "add_or_remove_one_user",
        "contribution": (
            "each sampled user's examples (at most max_examples_per_user, a "
            "uniform subset) are clipped one by one and averaged, so one "
            "user moves the clipped sum by at most C"),
        "overflow_policy": (
            "extra microbatches of the same shape; no example is dropped, so "
            "Poisson accounting is exact"),
    }


class CyclicPoissonSampler:
  """Cyclic Poisson sampling, jax-privacy's `CyclicPoissonSampling` (the
  sampling BandMF's amplification needs), random access by step.

  Formal guarantees:
    jax-privacy's: the `N` examples are assigned to `cycle_length` = b
    groups independently and uniformly (`PartitionType.INDEPENDENT`, the
    partition that holds under add-or-remove adjacency), and step t
    includes each example of group t mod b independently with probability
    `sampling_rate` = B / (N // b), so an example can be in step t only if
    t ≡ its group (mod b): b-min-separated participations. Every draw comes
    from `np.random.default_rng([seed, CYCLIC_STREAM])` (the secret sampling
    seed), one stream for the run: step t is the t-th batch of jax-privacy's
    iterator (`indices` replays it from the start for an earlier step, so a
    resumed run draws the batches of the uninterrupted one). Nothing sampled
    is dropped (no truncation); the overflow policy is `PoissonSampler`'s.
  """

  def __init__(self, dataset_size: int, expected_batch_size: float, *,
               cycle_length: int, steps: int, seed: int,
               overflow_probability: float = 1e-6):
    if not 1 <= cycle_length <= dataset_size // max(expected_batch_size, 1):
      raise ValueError(
          f"cycle_length must be in [1, N // B = "
          f"{dataset_size // max(int(expected_batch_size), 1)}], got "
          f"{cycle_length}.")
    self.dataset_size = int(dataset_size)
    self.cycle_length = int(cycle_length)
    self.steps = int(steps)
    self.seed = int(seed)
    self.sampling_rate = float(expected_batch_size) / (
        self.dataset_size // self.cycle_length)
    # Group sizes are Binomial(N, 1/b); a Binomial(N, q/b) bounds a step's
    # sample at the overflow probability.
    self.max_batch_size = PoissonSampler(
        self.dataset_size, sampling_rate=self.sampling_rate / cycle_length,
        seed=0, overflow_probability=overflow_probability).max_batch_size
    self._batches, self._next = None, 0

  @property
  def expected_batch_size(self) -> float:
    """The expected examples per step: `q * (N // b)`."""
    return self.sampling_rate * (self.dataset_size // self.cycle_length)

  def indices(self, step: int) -> np.ndarray:
    """Sorted int64 indices of step `step`'s sample."""
    if not 0 <= step < self.steps:
      raise ValueError(f"step must be in [0, {self.steps}), got {step}.")
    if self._batches is None or step < self._next:
      from jax_privacy import batch_selection  # only BandMF runs need it
      strategy = batch_selection.CyclicPoissonSampling(
          sampling_prob=self.sampling_rate, iterations=self.steps,
          cycle_length=self.cycle_length,
          partition_type=batch_selection.PartitionType.INDEPENDENT)
      self._batches = strategy.batch_iterator(
          self.dataset_size, rng=np.random.default_rng(
              [self.seed, CYCLIC_STREAM]))
      self._next = 0
    while True:
      batch = next(self._batches)
      self._next += 1
      if self._next - 1 == step:
        return np.sort(batch).astype(np.int64)

  def microbatches(self, step: int,
                   microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(idx [K, m], mask [K, m])` as `PoissonSampler.microbatches`."""
    return _pack_poisson(self.indices(step), self.max_batch_size,
                         microbatch_size)

  @property
  def scheme(self) -> PoissonScheme:
    """The accounting: Poisson at `sampling_rate`, cycle length b."""
    return PoissonScheme(self.sampling_rate, cycle_length=self.cycle_length)

  def describe(self) -> dict:
    """The sampling as the privacy ledger records it (JSON)."""
    return {
        "method": "cyclic_poisson",
        "sampling_rate": self.sampling_rate,
        "cycle_length": self.cycle_length,
        "dataset_size": self.dataset_size,
        "expected_batch_size": self.expected_batch_size,
        "max_batch_size": self.max_batch_size,
        "adjacency": self.scheme.neighbouring.value,
        "partition": "independent (jax_privacy.batch_selection)",
        "accounting": (
            "b-banded column-normalised BandMF with b = cycle_length: each "
            "round of b steps is one Poisson subsampled Gaussian at "
            "sampling_rate (Choquette-Choo et al. 2023, Theorem 4)"),
    }


class ShuffleSampler:
  """Fixed-size batches from a fresh random permutation each epoch.

  Formal guarantees:
    Epoch `e` uses the permutation from
    `np.random.default_rng([seed, e, SHUFFLE_STREAM])`, independent of the
    data; its first `steps_per_epoch * batch_size` entries are cut into
    batches and the remainder is dropped for that epoch. Each example is in at
    most one batch per epoch, so under replace-one adjacency an epoch is one
    Gaussian mechanism with sensitivity `2C`, i.e. effective noise multiplier
    `sigma / 2` (no amplification claimed); epochs compose and a partial epoch
    counts as a full one (`accounting.shuffle_epochs_event`).
  """

  def __init__(self, dataset_size: int, batch_size: int, *, seed: int):
    if not 1 <= batch_size <= dataset_size:
      raise ValueError(f"batch_size must be in [1, dataset_size={dataset_size}]"
                       f", got {batch_size}.")
    self.dataset_size = int(dataset_size)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.steps_per_epoch = self.dataset_size // self.batch_size

  @property
  def max_batch_size(self) -> int:
    """The compiled batch shape: every batch has exactly `batch_size`."""
    return self.batch_size

  def indices(self, step: int) -> np.ndarray:
    """Exactly `batch_size` int64 indices for `step`."""
    epoch, position = divmod(step, self.steps_per_epoch)
    perm = np.random.default_rng(
        [self.seed, epoch, SHUFFLE_STREAM]).permutation(self.dataset_size)
    start = position * self.batch_size
    return perm[start:start + self.batch_size].astype(np.int64)

  def microbatches(self, step: int,
                   microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(idx [K, m], mask [K, m])`, `K = ceil(batch_size / m)`, padded by 0s."""
    _check_microbatch_size(microbatch_size)
    return _pack(self.indices(step),
                 math.ceil(self.batch_size / microbatch_size), microbatch_size)

  @property
  def scheme(self) -> ShuffleScheme:
    """The accounting: shuffling, `steps_per_epoch` steps an epoch."""
    return ShuffleScheme(self.steps_per_epoch)

  def describe(self) -> dict:
    """The sampling as the privacy ledger records it (JSON)."""
    return {
        "method": "shuffle",
        "dataset_size": self.dataset_size,
        "batch_size": self.batch_size,
        "steps_per_epoch": self.steps_per_epoch,
        "adjacency": self.scheme.neighbouring.value,
        "accounting": (
            "each example is in one batch per epoch; replace-one sensitivity "
            "2C, so each (partial) epoch is one Gaussian mechanism with noise "
            "multiplier sigma/2; no amplification by shuffling is claimed"),
    }
