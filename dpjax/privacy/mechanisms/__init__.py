"""DP mechanisms: each one object in one module, chosen by the run's settings.

`dpsgd.DPSGD` is DP-SGD and the interface (its docstring says what a
mechanism provides); `bandmf.BandMF` (banded correlated noise),
`adaptive_clipping.AdaptiveDPSGD` (a clip norm that follows a private
quantile) and `user_level.UserLevel` (users as the unit) derive from it.
`multi_loss` builds every mechanism's clipped sums, one release per named
loss, and `redaction_schedule` decides which steps are DP steps at all.

Adding a mechanism is one module: subclass `DPSGD`, override what differs,
and `register` it; `train.mechanism = '<name>'` then selects it.
"""
from __future__ import annotations

from typing import Mapping

from dpjax import errors
from dpjax.privacy.mechanisms import adaptive_clipping, bandmf, user_level
from dpjax.privacy.mechanisms.dpsgd import DPSGD, PlanInputs

_REGISTRY: dict[str, type[DPSGD]] = {}


def register(mechanism: type[DPSGD]) -> type[DPSGD]:
  """Makes `mechanism` selectable (by `mechanism.chosen`); a class
  decorator."""
  _REGISTRY[mechanism.name] = mechanism
  return mechanism


def names() -> tuple[str, ...]:
  """The values of `train.mechanism`."""
  return tuple(n for n, m in _REGISTRY.items() if m.named)


def from_config(config) -> DPSGD:
  """The mechanism `config` selects, its settings checked: DP-SGD unless
  one other mechanism's setting chooses it; one UsageError for an unknown
  name or unit, or two settings that do not combine."""
  if config.mechanism not in names():
    raise errors.UsageError(f"train.mechanism must be one of {names()}, got "
                             f"{config.mechanism!r}")
  units = tuple(dict.fromkeys(m.unit for m in _REGISTRY.values()))
  if config.privacy_unit not in units:
    raise errors.UsageError(f"train.privacy_unit must be one of {units}, got "
                             f"{config.privacy_unit!r}")
  chosen = [m for n, m in _REGISTRY.items()
            if n != DPSGD.name and m.chosen(config)]
  if len(chosen) > 1:
    raise errors.UsageError(f"{chosen[0].setting} does not combine with "
                             f"{chosen[1].setting}")
  return (chosen[0] if chosen else DPSGD).from_config(config)


def from_plan(plan: Mapping) -> DPSGD:
  """The resolved mechanism of a saved plan (`Plan.guarantee()`): the one
  whose record it holds, else DP-SGD."""
  for mechanism in _REGISTRY.values():
    if mechanism.record_key and plan.get(mechanism.record_key) is not None:
      return mechanism.from_plan(plan)
  return DPSGD.from_plan(plan)


for _mechanism in (DPSGD, bandmf.BandMF, adaptive_clipping.AdaptiveDPSGD,
                   user_level.UserLevel):
  register(_mechanism)

__all__ = ["DPSGD", "PlanInputs", "from_config", "from_plan", "names",
           "register"]
