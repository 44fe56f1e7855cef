"""The redaction schedule: which training steps are non-private steps on
redacted data, decided by public coin flips before training starts.

Kabra & Elenberg's "Redaction Schedule" (Findings of EMNLP 2023, arXiv
2305.14208, Sec. 5.2 and App. D) fine-tunes in one stage: at step t of T, with
probability p(t) one non-private optimizer step on a batch of the REDACTED
data, else one DP step on a batch of the original data; p falls from about 1 to
about 0:

  linear       p(t) = 1 - t/T
  step         p(t) = 1 for t < T/2, else 0   (JFT's halves, one optimizer)
  exp_convex   p(t) = exp(-eta t/T)
  exp_concave  p(t) = 1 - exp((eta/T)(t - T))  (the paper's choice, eta = 15)
  constant     p(t) = p

The paper writes exp_convex as exp(-eta t) with t in epochs (T = 10 in its
Figure 3). Here t counts steps and is divided by T in both exponential
schedules, so eta means the same for both and exp_convex is exp_concave
mirrored in time: p_convex(t) = 1 - p_concave(T - t).

Formal guarantees
-----------------
`public_steps(p, seed)` decides step t by `u_t < p(t)`, where `u_t` is the
t-th uniform of `numpy.random.default_rng([seed, COIN_STREAM])`: a function
of (seed, t) alone that never sees any data. So which steps are DP steps, and
their number N_dp, are fixed before training and are the same on neighbouring
datasets. The DP steps are then an ordinary DP-SGD run of exactly N_dp
releases (Poisson sampling of the original data, noise calibrated for N_dp
releases), and composing N_dp accountant events is exact: N_dp is not a
random variable of the mechanism. The coins may be published.

The non-private steps read the redacted data without clipping or noise. The
parameters are post-processing of the N_dp releases (and each DP step's
input a function of earlier releases, which adaptive composition allows)
only if the redacted data is PUBLIC, i.e. the same on neighbouring datasets.
That is the paper's premise: the guarantee is Selective DP for the redaction
policy F (paper, Def. 3.1), whose neighbours differ only in tokens F flags,
which redaction maps to the same redacted data. It is NOT example-level DP
for the original data (adding or removing a dialogue also changes the
redacted data, which the public steps read as is), and it holds only as far
as the policy flags every sensitive token, which no accountant can check.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from dpjax import errors
from dpjax.privacy import sampling

SCHEDULES = ("linear", "step", "exp_convex", "exp_concave", "constant")
# Separates the coin flips from any other use of the same seed.
COIN_STREAM = 0x636F696E  # "coin"
# Seeds the public sampler apart from the secret Poisson sampler's stream.
PUBLIC_SAMPLER_STREAM = 0x70756273  # "pubs"


def probabilities(name: str, total_steps: int, *, eta: float = 15.0,
                  p: float | None = None) -> np.ndarray:
  """p(t) for t = 0 .. T-1: the probability that step t is a redacted step.

  Args:
    name: One of `SCHEDULES`.
    total_steps: T, all steps of the run (redacted and DP).
    eta: The temperature of the exponential schedules (> 0).
    p: The probability of the 'constant' schedule, in [0, 1].

  Returns:
    float64 array of shape [T], values in [0, 1].
  """
  if int(total_steps) != total_steps or total_steps < 1:
    raise ValueError(f"total_steps must be an integer >= 1, got {total_steps}")
  if name not in SCHEDULES:
    raise ValueError(f"unknown redaction schedule {name!r}; choose from "
                     f"{list(SCHEDULES)}")
  if name.startswith("exp") and not (eta > 0 and math.isfinite(eta)):
    raise ValueError(f"the {name} schedule needs eta > 0, got {eta}")
  if (name == "constant") != (p is not None):
    raise ValueError("give p exactly for the 'constant' schedule, got "
                     f"p={p} for {name!r}")
  if name == "constant" and not 0 <= p <= 1:
    raise ValueError(f"p must be in [0, 1], got {p}")
  t = np.arange(total_steps, dtype=np.float64)
  big_t = float(total_steps)
  if name == "linear":
    return 1.0 - t / big_t
  if name == "step":
    return (t < big_t / 2).astype(np.float64)
  if name == "exp_convex":
    return np.exp(-eta * t / big_t)
  if name == "exp_concave":
    return -np.expm1(eta / big_t * (t - big_t))
  return np.full(total_steps, float(p))


def public_steps(probs: np.ndarray, seed: int) -> np.ndarray:
  """bool [T]: True where step t is a non-private step on redacted data.

  Step t is redacted iff `u_t < probs[t]`, with `u_t` uniform in [0, 1) from
  the seeded stream (see the module's guarantees); so p = 1 is always
  redacted, p = 0 never, and `u_t` does not depend on T.
  """
  probs = np.asarray(probs, np.float64)
  coins = np.random.default_rng([seed, COIN_STREAM]).random(probs.size)
  return coins < probs


def kind_indices(public: np.ndarray) -> np.ndarray:
  """int64 [T]: for each step, how many steps of its own kind precede it.

  A DP step's index is its release number (noise key, Poisson sample, ledger
  position); a redacted step's is its position in the redacted stream.
  """
  is_dp = ~np.asarray(public, bool)
  dp_before = np.cumsum(is_dp) - is_dp  # exclusive prefix count
  return np.where(is_dp, dp_before, np.arange(is_dp.size) - dp_before)


def plan(schedule: str, *, total_steps: int, eta: float,
         probability: float | None, seed: int, public_task: str,
         public_dataset_size: int) -> tuple[np.ndarray, dict]:
  """(public [T] bool: the redacted steps, the description the run's plan
  keeps). The coins are flipped here, before training, from (seed, t)
  alone, so the number of DP steps the accountant is calibrated for is
  exact."""
  try:
    probs = probabilities(schedule, total_steps, eta=eta, p=probability)
  except ValueError as e:
    raise errors.UsageError(f"train.redaction_schedule: {e}") from None
  public = public_steps(probs, seed)
  return public, {
      "schedule": schedule, "eta": eta, "probability": probability,
      "public_task": public_task, "public_dataset_size": public_dataset_size,
      "dp_steps": int(np.count_nonzero(~public)),
      "public_steps": int(np.count_nonzero(public))}


def dp_steps_before(plan: Mapping, step: int) -> int:
  """The DP steps among the first `step` under a saved plan's schedule
  (its public coins, from the plan's seed); `step` without one."""
  redaction = plan.get("redaction")
  if not redaction:
    return step
  probs = probabilities(redaction["schedule"], int(plan["steps"]),
                        eta=redaction["eta"], p=redaction["probability"])
  public = public_steps(probs, int(plan["seed"]))
  return int(np.count_nonzero(~public[:step]))


def public_sampler(n: int, batch_size: int, seed: int
                    ) -> sampling.ShuffleSampler:
  """Shuffled batches of exactly BATCH_SIZE public rows. Public data needs
  no Poisson sampling; its seed is drawn apart from the run's so that
  public batches say nothing about the secret Poisson samples."""
  public_seed = int(np.random.SeedSequence(
      [seed, PUBLIC_SAMPLER_STREAM]).generate_state(1)[0])
  try:
    return sampling.ShuffleSampler(n, batch_size, seed=public_seed)
  except ValueError as e:
    raise errors.UsageError(f"train.public_task_name: {e}") from None
