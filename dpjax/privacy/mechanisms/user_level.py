"""User-level DP: a user, with all their examples, is the unit of privacy.

`train.privacy_unit = 'user'`: each step Poisson-samples users (not
examples) and takes at most `max_examples_per_user` of each sampled user's
examples, weighted so that a user's clipped gradients are averaged
(`sampling.UserPoissonSampler`). The task names each example's user in its
feature `user_column`; BATCH_SIZE, n, δ and epochs then count users.

Formal guarantees
-----------------
With every example clipped to C and a user's weights summing to 1, adding
or removing one user (all their examples) moves the clipped sum by at most
C: a step is DP-SGD's subsampled Gaussian at the user sampling rate, with
the number of users as the dataset size (`sampling.PoissonScheme` with
`unit='user'`). Everything else is DP-SGD's (`dpsgd.DPSGD`).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from dpjax import errors
from dpjax.privacy import sampling
from dpjax.privacy.mechanisms import dpsgd


@dataclasses.dataclass(frozen=True)
class UserLevel(dpsgd.DPSGD):
  """DP-SGD with Poisson sampling of users, at most k examples each."""
  name: ClassVar[str] = "user_level"
  record_key: ClassVar[str] = "user_level"
  setting: ClassVar[str] = "train.privacy_unit = 'user'"
  named: ClassVar[bool] = False
  unit: ClassVar[str] = "user"

  user_column: str = "user_id"
  max_examples_per_user: int = 8

  @classmethod
  def chosen(cls, config) -> bool:
    return config.privacy_unit == cls.unit

  @classmethod
  def from_config(cls, config) -> UserLevel:
    k = config.max_examples_per_user
    if not errors.is_int(k) or k < 1:
      raise errors.UsageError("train.max_examples_per_user must be a "
                               f"positive integer, got {k!r}")
    if config.sampling_method != "poisson":
      raise errors.UsageError(
          "train.privacy_unit = 'user' samples users by Poisson sampling: "
          f"train.sampling_method must be 'poisson', got "
          f"{config.sampling_method!r}")
    return cls("poisson", config.user_column, int(k))

  @classmethod
  def from_plan(cls, plan) -> UserLevel:
    record = plan["user_level"]
    return cls("poisson", record["user_column"],
               int(record["max_examples_per_user"]))

  @property
  def unit_column(self) -> str:
    return self.user_column

  def privacy_units(self, n, unit_ids) -> int:
    if unit_ids is None or len(unit_ids) != n:
      raise ValueError("train.privacy_unit = 'user' needs each of the n "
                       "examples' user ids")
    return int(np.unique(unit_ids).size)

  def sampler(self, inputs, *, seed, unit_ids=None):
    return sampling.UserPoissonSampler(
        unit_ids, inputs.batch_size, seed=seed,
        max_examples_per_user=self.max_examples_per_user,
        overflow_probability=inputs.overflow_probability)

  def scheme(self, n, batch_size):
    return sampling.PoissonScheme(float(batch_size) / n, unit="user")

  def record(self) -> dict:
    return {"user_column": self.user_column,
            "max_examples_per_user": self.max_examples_per_user}

  def describe_sampling(self, sampler, n, batch_size) -> str:
    return (f"Poisson sampling of users (q={batch_size / n:.4g} of {n} "
            f"users, <= {self.max_examples_per_user} examples each)")
