"""Privacy accounting: JSON-serialisable event records over `dp_accounting`.

An event record is a small frozen dataclass describing `count` repetitions of
one mechanism, convertible to a `dp_accounting.DpEvent`. A run's privacy cost
is the composition (`ComposedDpEvent`) of all its records, whatever their
kinds: DP-SGD steps, shuffled epochs, PATE-style Gaussian or Laplace queries,
several trainings sharing one budget.

Formal guarantees
-----------------
* `PoissonGaussian(q, (s_1, ..., s_k), T)`: T steps, each releasing k Gaussian
  mechanisms (noise multipliers s_i, i.e. noise `s_i * C_i` on sums of
  sensitivity `C_i`) computed on the SAME Poisson sample of rate q, under
  add-or-remove-one adjacency. For PLD accounting the k releases are replaced
  by the single Gaussian with `s = (sum_i s_i^-2)^(-1/2)`, which has exactly
  the same privacy loss distribution (RDP does the same internally).
* `Gaussian(s, T)`: T unamplified Gaussian mechanisms with noise multiplier s
  (noise std / L2 sensitivity). Its guarantee holds under whichever adjacency
  the sensitivity was computed for; `shuffle_epochs_event` uses replace-one.
* `Laplace(s, T)`: T unamplified Laplace mechanisms with noise multiplier s
  (Laplace scale b / L1 sensitivity), i.e. pure (1/s)-DP each; composed by
  dp-accounting (RDP: Mironov 2017, Prop. 6; PLD: the exact Laplace PLD)
  under the adjacency of the sensitivity, like `Gaussian`. s = 0 (no noise)
  is non-private.
* `epsilon` returns an upper bound on epsilon at the given delta (RDP
  conversion, or PLD with pessimistic discretization); `calibrate_*` return a
  noise multiplier whose epsilon is <= the target (and within 1% of it).

Composing events only makes sense under one adjacency notion; add-or-remove
events composed with replace-one shuffle events give a bound under
replace-one only if the add/remove epsilons are first doubled, which this
module does not do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, ClassVar, Sequence, Union

import dp_accounting
import numpy as np
from dp_accounting import pld
from dp_accounting import rdp
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

ACCOUNTANTS = ("rdp", "pld")
# Denser than dp_accounting's default, for tighter RDP -> (eps, delta).
RDP_ORDERS = tuple(sorted(set(
    [1 + x / 20 for x in range(1, 200)] + list(range(11, 257))
    + [512, 1024, 2048, 4096])))
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3
# Relative tolerance of noise calibration, in noise-multiplier space.
_CALIBRATION_RTOL = 1e-6


def _check_noise_multiplier(noise_multiplier: float) -> None:
  if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
    raise ValueError(
        f"noise_multiplier must be finite and >= 0, got {noise_multiplier}.")


def _check_sampling_rate(sampling_rate: float) -> None:
  if not 0 < sampling_rate <= 1:
    raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")


def _check_count(name: str, count: int) -> None:
  if int(count) != count or count < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {count}.")


def _check_delta(delta: float) -> None:
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1), got {delta}.")


def _check_epsilon(epsilon: float) -> None:
  if not epsilon > 0:  # Also rejects NaN.
    raise ValueError(f"epsilon must be > 0, got {epsilon}.")


def _check_accountant(accountant: str) -> None:
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, "
                     f"got {accountant!r}.")


def effective_noise_multiplier(noise_multipliers: Sequence[float]) -> float:
  """The one Gaussian equivalent to several on the same data: (sum s^-2)^-1/2.

  Zero if any multiplier is zero (that release alone is non-private).
  """
  if min(noise_multipliers) == 0:
    return 0.0
  return sum(s ** -2 for s in noise_multipliers) ** -0.5


@dataclasses.dataclass(frozen=True)
class PoissonGaussian:
  """`count` DP-SGD steps on Poisson samples of rate `sampling_rate`.

  Each step releases one Gaussian per entry of `noise_multipliers`, all on the
  same sample (e.g. separately clipped and noised heads).
  """

  sampling_rate: float
  noise_multipliers: tuple[float, ...]
  count: int = 1
  TYPE: ClassVar[str] = "poisson_gaussian"

  def __post_init__(self):
    multipliers = tuple(float(s) for s in self.noise_multipliers)
    if not multipliers:
      raise ValueError("noise_multipliers must not be empty.")
    for s in multipliers:
      _check_noise_multiplier(s)
    _check_sampling_rate(self.sampling_rate)
    _check_count("count", self.count)
    object.__setattr__(self, "noise_multipliers", multipliers)
    object.__setattr__(self, "sampling_rate", float(self.sampling_rate))
    object.__setattr__(self, "count", int(self.count))

  def to_dp_event(self) -> dp_accounting.DpEvent:
    """The event as a `dp_accounting.DpEvent`.

    A step with a noiseless release is accounted as one noiseless Gaussian
    (non-private).
    """
    # A noiseless release makes the step non-private whatever else it
    # releases; dp-accounting cannot compose several noiseless Gaussians.
    multipliers = (0.0,) if 0.0 in self.noise_multipliers else self.noise_multipliers
    gaussians = [dp_accounting.GaussianDpEvent(s) for s in multipliers]
    inner = (gaussians[0] if len(gaussians) == 1
             else dp_accounting.ComposedDpEvent(gaussians))
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(self.sampling_rate, inner),
        self.count)

  def to_json(self) -> dict:
    """The event as JSON (`event_from_json` reads it back)."""
    return {"type": self.TYPE, "sampling_rate": self.sampling_rate,
            "noise_multipliers": list(self.noise_multipliers),
            "count": self.count}


@dataclasses.dataclass(frozen=True)
class _SelfComposed:
  """`count` unamplified mechanisms with noise multiplier s (`_one`)."""

  noise_multiplier: float
  count: int = 1

  def __post_init__(self):
    _check_noise_multiplier(self.noise_multiplier)
    _check_count("count", self.count)
    object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
    object.__setattr__(self, "count", int(self.count))

  def to_dp_event(self) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(self._one(), self.count)

  def to_json(self) -> dict:
    return {"type": self.TYPE, "noise_multiplier": self.noise_multiplier,
            "count": self.count}


@dataclasses.dataclass(frozen=True)
class Gaussian(_SelfComposed):
  """`count` unamplified Gaussian mechanisms with noise multiplier s."""

  TYPE: ClassVar[str] = "gaussian"

  def _one(self) -> dp_accounting.DpEvent:
    return dp_accounting.GaussianDpEvent(self.noise_multiplier)


@dataclasses.dataclass(frozen=True)
class Laplace(_SelfComposed):
  """`count` unamplified Laplace mechanisms with noise multiplier s (the
  Laplace scale b divided by the L1 sensitivity)."""

  TYPE: ClassVar[str] = "laplace"

  def _one(self) -> dp_accounting.DpEvent:
    # dp-accounting's RDP of a Laplace event divides by its multiplier.
    if self.noise_multiplier == 0:
      return dp_accounting.NonPrivateDpEvent()
    return dp_accounting.LaplaceDpEvent(self.noise_multiplier)


Event = Union[PoissonGaussian, Gaussian, Laplace]
_EVENT_TYPES = {cls.TYPE: cls for cls in (PoissonGaussian, Gaussian, Laplace)}


def event_from_json(d: dict) -> Event:
  """Inverse of `Event.to_json()`."""
  fields = dict(d)
  kind = fields.pop("type", None)
  if kind not in _EVENT_TYPES:
    raise ValueError(f"Unknown event type {kind!r}; expected one of "
                     f"{sorted(_EVENT_TYPES)}.")
  return _EVENT_TYPES[kind](**fields)


def merge(last: Event, new: Event) -> Event | None:
  """`last` with `new.count` added if they differ only in count, else None."""
  if dataclasses.replace(last, count=1) == dataclasses.replace(new, count=1):
    return dataclasses.replace(last, count=last.count + new.count)
  return None


def shuffle_epochs_event(noise_multiplier: float, epochs: int) -> Gaussian:
  """Accounting for `epochs` (partial epochs rounded up) of shuffled DP-SGD.

  Under replace-one adjacency each epoch's clipped sums change by at most
  `2C` in total, so an epoch is one Gaussian with noise multiplier `s / 2`.
  """
  _check_noise_multiplier(noise_multiplier)
  return Gaussian(noise_multiplier / 2, epochs)


def _make_accountant(accountant: str) -> dp_accounting.PrivacyAccountant:
  if accountant == "rdp":
    return rdp.RdpAccountant(orders=RDP_ORDERS)
  return pld.PLDAccountant(
      value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)


def _dp_event_for(event: Event, accountant: str) -> dp_accounting.DpEvent:
  if accountant == "pld" and isinstance(event, PoissonGaussian):
    # PLDAccountant only takes a single Gaussian under Poisson sampling.
    event = dataclasses.replace(event, noise_multipliers=(
        effective_noise_multiplier(event.noise_multipliers),))
  return event.to_dp_event()


def _compose(events: Sequence[Event], accountant: str) -> dp_accounting.DpEvent:
  return dp_accounting.ComposedDpEvent(
      [_dp_event_for(e, accountant) for e in events])


def epsilon(events: Sequence[Event], delta: float,
            accountant: str = "pld") -> float:
  """Epsilon at `delta` of the composition of `events` (0.0 if none).

  Equal, float for float, to dp-accounting's accountant composing the events
  (tested), but fast when only the counts change, as in a run's progress
  line: the costly part, one repetition of each mechanism (its RDP curve, or
  a subsampled Gaussian's privacy loss distribution), is computed once per
  mechanism and reused; the counts only scale (RDP) or self-compose (PLD) it.
  """
  _check_delta(delta)
  _check_accountant(accountant)
  if not events:
    return 0.0
  if accountant == "rdp":
    curve = sum(e.count * _unit_rdp(dataclasses.replace(e, count=1))
                for e in events)
    return float(rdp_privacy_accountant.compute_epsilon(
        RDP_ORDERS, curve, delta)[0])
  if not all(_has_unit_pld(e) for e in events):
    return float(_make_accountant(accountant).compose(
        _compose(events, accountant)).get_epsilon(delta))
  # As dp-accounting's PLDAccountant composes a Poisson-subsampled Gaussian.
  loss = privacy_loss_distribution.identity(
      value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
  for e in events:
    loss = loss.compose(_unit_pld(dataclasses.replace(e, count=1))
                        .self_compose(e.count))
  return float(loss.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=256)
def _unit_rdp(event: Event) -> np.ndarray:
  """The RDP curve (over RDP_ORDERS) of one repetition of `event`."""
  accountant = rdp.RdpAccountant(orders=RDP_ORDERS)
  accountant.compose(_dp_event_for(event, "rdp"))
  curve = accountant._rdp  # pylint: disable=protected-access
  curve.setflags(write=False)
  return curve


def _has_unit_pld(event: Event) -> bool:
  return (isinstance(event, PoissonGaussian)
          and effective_noise_multiplier(event.noise_multipliers) > 0)


@functools.lru_cache(maxsize=8)  # a PLD can take megabytes
def _unit_pld(event: PoissonGaussian):
  """The privacy loss distribution of one step of a PoissonGaussian."""
  return privacy_loss_distribution.from_gaussian_mechanism(
      standard_deviation=effective_noise_multiplier(event.noise_multipliers),
      value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL,
      sampling_prob=event.sampling_rate)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    make_events: Callable[[float], Sequence[Event]],
    accountant: str = "pld",
) -> float:
  """Smallest noise multiplier s with epsilon(make_events(s)) <= target.

  `make_events` must be monotone: more noise, less epsilon. Returns 0.0 for
  `target_epsilon == inf`. The result's epsilon is <= the target (guaranteed
  by `dp_accounting.calibrate_dp_mechanism`) and, for continuous accounting,
  within 1% of it.
  """
  _check_epsilon(target_epsilon)
  _check_delta(delta)
  _check_accountant(accountant)
  if target_epsilon == math.inf:
    return 0.0

  def gap(s: float) -> float:
    return epsilon(make_events(s), delta, accountant) - target_epsilon

  # Explicit bracket [lo, hi] with gap(lo) > 0 >= gap(hi), avoiding s = 0
  # where epsilon is infinite.
  lo, hi = None, 1.0
  while gap(hi) > 0:
    lo, hi = hi, 2 * hi
    if hi > 2.0 ** 40:
      raise ValueError(f"No noise multiplier <= 2^40 reaches epsilon "
                       f"{target_epsilon} at delta {delta}.")
  if lo is None:
    lo = hi / 2
    while gap(lo) <= 0:
      hi, lo = lo, lo / 2
      if lo < 1e-6:  # Target so loose that almost no noise meets it.
        return hi
  return float(dp_accounting.calibrate_dp_mechanism(
      lambda: _make_accountant(accountant),
      lambda s: _compose(make_events(s), accountant),
      target_epsilon, delta,
      bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
      tol=_CALIBRATION_RTOL * hi))


def calibrate(target_epsilon: float, delta: float, scheme,
              stage_steps: Sequence[int], *, releases_per_step: int = 1,
              accountant: str = "pld",
              prior_events: Sequence[Event] = (),
              fixed_multipliers: Sequence[float] = ()) -> float:
  """The smallest σ with which `prior_events` and then, for each stage, its
  steps of `releases_per_step` Gaussians (one σ for all) under the sampling
  `scheme` (a sampler's `scheme`: its `events(noise_multipliers, steps)`)
  meet (target_epsilon, delta); 0 for ε = ∞ or no step at all. Stages are
  separate runs on the same data (e.g. the LM and then a head on it
  frozen): a shuffled stage starts its own epochs.
  `fixed_multipliers`: more Gaussians of each step, on the same sample, whose
  noise is set (adaptive clipping's counts): calibrated together with σ.
  A pure function of its arguments, remembered: a pipeline (or a test
  suite) that plans the same runs again does not search again."""
  return _calibrate(float(target_epsilon), float(delta), scheme,
                    tuple(int(t) for t in stage_steps), int(releases_per_step),
                    accountant, tuple(prior_events),
                    tuple(float(s) for s in fixed_multipliers))


@functools.lru_cache(maxsize=256)
def _calibrate(target_epsilon: float, delta: float, scheme,
               stage_steps: tuple[int, ...], releases_per_step: int,
               accountant: str, prior_events: tuple[Event, ...],
               fixed_multipliers: tuple[float, ...]) -> float:
  if math.isinf(target_epsilon) or not any(stage_steps):
    return 0.0

  def events(s):
    return list(prior_events) + [
        e for steps in stage_steps
        for e in scheme.events((s,) * releases_per_step
                               + fixed_multipliers, steps)]

  return calibrate_noise_multiplier(target_epsilon, delta, events,
                                    accountant=accountant)


def dpsgd_epsilon(noise_multiplier: float, sampling_rate: float, steps: int,
                  delta: float, accountant: str = "pld") -> float:
  """Epsilon of `steps` Poisson-sampled DP-SGD steps."""
  _check_count("steps", steps)
  return epsilon([PoissonGaussian(sampling_rate, (noise_multiplier,), steps)],
                 delta, accountant)


def dpsgd_noise_multiplier(target_epsilon: float, delta: float,
                           sampling_rate: float, steps: int,
                           accountant: str = "pld") -> float:
  """Noise multiplier for `steps` Poisson-sampled DP-SGD steps at a target."""
  _check_sampling_rate(sampling_rate)
  _check_count("steps", steps)
  return calibrate_noise_multiplier(
      target_epsilon, delta,
      lambda s: [PoissonGaussian(sampling_rate, (s,), steps)], accountant)
