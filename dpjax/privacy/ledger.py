"""The privacy ledger: a durable record of every DP release a run has made.

Formal guarantees
-----------------
`epsilon_spent()` upper-bounds the privacy cost (at `delta`) of the releases
recorded so far, as the composition of `prior_events` (releases of earlier
runs on the same data, e.g. stage 1 of a two-stage pipeline) and `events`; it
is only as complete as the recording. `check_budget(planned)` refuses, before any release, plans
whose total epsilon would exceed `target_epsilon`. `save` is atomic: a crash
at any point leaves either the previous or the new file, never a torn one, so
a resumed run never forgets spent budget that had been saved.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

from dpjax import fileio
from dpjax.privacy import accounting, sampling as sampling_lib

LEDGER_FILENAME = "privacy_ledger.json"
# Slack for float noise when the plan was calibrated to exactly the target.
_BUDGET_RTOL = 1e-9


class BudgetExceededError(ValueError):
  """A planned release would take the run past its target epsilon."""


def _encode_float(x: float) -> float | str:
  # Strict JSON has no infinity; "inf" round-trips through float().
  return x if math.isfinite(x) else str(x)


@dataclasses.dataclass
class PrivacyLedger:
  """Privacy parameters of a run and the events it has released.

  Attributes:
    accountant: "rdp" or "pld".
    sampling: The sampler's `describe()` dict.
    noise_multiplier: The run's noise multiplier.
    clip_norm: The L2 sensitivity of the clipped sum (L1 for a run of
      `accounting.Laplace` events).
    dataset_size: Number of training units (examples, or users).
    delta: Target delta.
    target_epsilon: Budget; may be inf.
    steps: DP steps recorded with `record_dp_steps`.
    events: Recorded `accounting.Event`s, in order.
    prior_events: Releases of earlier runs on the same data that this run's
      guarantee composes with (`compose_after`); counted in every epsilon.
    secret: Where the key of the noise and sampling came from: 'os_entropy'
      (`secret.RunSecret.draw`), 'pinned' (known to whoever pinned it: the
      guarantee does not hold against them) or 'unknown' (a ledger written
      before dpjax recorded it).
    mechanism: The noise: 'dpsgd' (independent Gaussians), or
      {'name': 'bandmf', 'bands': b, ...} (BandMF's correlated noise,
      accounted through its cyclic Poisson `sampling`).
  """

  accountant: str
  sampling: dict
  noise_multiplier: float
  clip_norm: float
  dataset_size: int
  delta: float
  target_epsilon: float
  steps: int = 0
  events: list[accounting.Event] = dataclasses.field(default_factory=list)
  prior_events: list[accounting.Event] = dataclasses.field(default_factory=list)
  secret: str = "unknown"
  mechanism: str | dict = "dpsgd"

  def compose_after(self, prior: PrivacyLedger) -> None:
    """Counts every release of `prior` (an earlier run on the same dataset
    and delta) in this ledger's epsilon and budget checks."""
    if (prior.dataset_size, prior.delta) != (self.dataset_size, self.delta):
      raise ValueError(
          f"cannot compose with a ledger of another dataset or delta: "
          f"n={prior.dataset_size}, δ={prior.delta} vs n={self.dataset_size},"
          f" δ={self.delta}")
    self.prior_events = prior.all_events

  def record(self, event: accounting.Event) -> None:
    """Appends `event`, merged into the last one if only the count differs."""
    if self.events and (merged := accounting.merge(self.events[-1], event)):
      self.events[-1] = merged
    else:
      self.events.append(event)

  def record_dp_steps(self, n: int = 1, *,
                      noise_multipliers: Sequence[float] | None = None) -> None:
    """Records the next `n` DP steps under this ledger's sampling scheme.

    `noise_multipliers`: the Gaussian releases of each step (default: the
    run's one noise multiplier; two clipped heads pass two).
    """
    for event in self.planned_events(self.steps + n, noise_multipliers):
      self.record(event)
    self.steps += n

  def planned_events(self, total_steps: int,
                     noise_multipliers: Sequence[float] | None = None
                     ) -> list[accounting.Event]:
    """The events of the steps from `self.steps` up to `total_steps`."""
    return sampling_lib.scheme_from_description(self.sampling).events(
        noise_multipliers or (self.noise_multiplier,), total_steps,
        start=self.steps)

  def events_for(self, steps: int,
                 noise_multipliers: Sequence[float] | None = None
                 ) -> list[accounting.Event]:
    """The events that `steps` DP steps from the start record, merged as
    `record` merges them: what `events` must be after `steps` steps."""
    fresh = dataclasses.replace(self, steps=0, events=[])
    fresh.record_dp_steps(steps, noise_multipliers=noise_multipliers)
    return fresh.events

  @property
  def all_events(self) -> list[accounting.Event]:
    """Every release this ledger's guarantee covers: prior runs', then its own."""
    return list(self.prior_events) + list(self.events)

  def epsilon_spent(self) -> float:
    """ε at `delta` of every release covered: prior and recorded events."""
    return accounting.epsilon(self.all_events, self.delta, self.accountant)

  def check_budget(self, planned: Sequence[accounting.Event]) -> None:
    """Raises `BudgetExceededError` if recorded + planned exceeds the target."""
    total = accounting.epsilon(
        self.all_events + list(planned), self.delta,
        self.accountant)
    if total > self.target_epsilon * (1 + _BUDGET_RTOL):
      over = total - self.target_epsilon
      raise BudgetExceededError(
          f"Planned epsilon {total:.6g} exceeds the target "
          f"{self.target_epsilon:.6g} (delta={self.delta:g}) by {over:.4g} "
          f"({100 * over / self.target_epsilon:.2f}%).")

  def to_json(self) -> dict:
    """The ledger as JSON, with `epsilon_spent` (`from_json` recomputes it)."""
    return {
        "accountant": self.accountant,
        "sampling": self.sampling,
        "noise_multiplier": self.noise_multiplier,
        "clip_norm": self.clip_norm,
        "dataset_size": self.dataset_size,
        "delta": self.delta,
        "target_epsilon": _encode_float(self.target_epsilon),
        "steps": self.steps,
        "events": [e.to_json() for e in self.events],
        "prior_events": [e.to_json() for e in self.prior_events],
        "secret": self.secret,
        "mechanism": self.mechanism,
        "epsilon_spent": _encode_float(self.epsilon_spent()),
    }

  @classmethod
  def from_json(cls, d: dict) -> PrivacyLedger:
    """Inverse of `to_json`; `epsilon_spent` is recomputed, not trusted."""
    return cls(
        accountant=d["accountant"],
        sampling=dict(d["sampling"]),
        noise_multiplier=float(d["noise_multiplier"]),
        clip_norm=float(d["clip_norm"]),
        dataset_size=int(d["dataset_size"]),
        delta=float(d["delta"]),
        target_epsilon=float(d["target_epsilon"]),
        steps=int(d["steps"]),
        events=[accounting.event_from_json(e) for e in d["events"]],
        prior_events=[accounting.event_from_json(e)
                      for e in d.get("prior_events", [])],
        secret=str(d.get("secret", "unknown")),
        mechanism=d.get("mechanism", "dpsgd"),
    )

  def save(self, path: str | os.PathLike) -> None:
    """Atomically writes the ledger as JSON to `path` (a local file)."""
    fileio.write_atomic(path, json.dumps(self.to_json(), indent=2,
                                         allow_nan=False))

  @classmethod
  def load(cls, path: str | os.PathLike) -> PrivacyLedger:
    """Reads a ledger written by `save`."""
    with open(path) as f:
      return cls.from_json(json.load(f))
