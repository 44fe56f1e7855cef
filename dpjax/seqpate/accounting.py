"""Privacy accounting of SeqPATE's teacher queries, as `dpjax.privacy` events.

One query is one answered (sentence, position) of the pseudo-data: the
teachers' summed next-token distributions plus N(0, sigma^2) per coordinate
(`dpjax.seqpate.aggregation`). A run has a budget of Q queries; sigma is the
noise standard deviation on the SUM of the teacher distributions.

Formal guarantees
-----------------
* Sample level. Each private example is in exactly one teacher's partition,
  and the partition does not depend on the examples' content
  (`dpjax.seqpate.partition`), so under replace-one adjacency changing one
  example changes one teacher. A teacher contributes a sub-probability
  vector x (its top-k probabilities, every other token 0: x >= 0,
  sum(x) <= 1), so the sum changes by x - x' with ||x - x'||_1 <= 2 and
  ||x - x'||_inf <= 1, hence ||x - x'||_2 <= sqrt(||.||_1 ||.||_inf) <= sqrt(2)
  (paper Sec. 5.2, App. C; disjoint point masses reach it). Each query is a
  Gaussian mechanism with noise multiplier sigma / sqrt(2); Q queries,
  chosen adaptively by the student, compose as `Gaussian(sigma / sqrt(2),
  Q)` (paper Lemma 5.2).
* The candidate set restricts which coordinates are released. It is chosen
  by the student from public data and earlier answers, before this query's
  noise is drawn, so releasing a subset of the coordinates of a Gaussian
  mechanism is post-processing: restriction never raises the sensitivity
  (a sub-vector's L2 norm is at most the vector's).
* Phrase level (paper Sec. 5.3, App. D). Neighbouring datasets differ in the
  occurrences of one secret phrase s; with a partition that depends only on
  user ids, only the n_s teachers holding s change, each by a
  sub-probability vector, so the sum changes by at most sqrt(2) n_s in L2
  (triangle inequality; n_s disjoint point masses reach it). The phrase's
  guarantee is `Gaussian(sigma / (sqrt(2) n_s), Q)`: ε grows with n_s, which
  `user_partition` keeps near 1.
* `calibrate_sigma` returns a sigma whose epsilon is <= the target (within
  1%, `dpjax.privacy.accounting.calibrate_noise_multiplier`).
"""
from __future__ import annotations

import math

import numpy as np

from dpjax.privacy import accounting
from dpjax.privacy import ledger as ledger_lib

SAMPLE_SENSITIVITY = math.sqrt(2.0)
DELTA = 1e-5  # the paper's delta
# `PrivacyLedger.sampling["method"]` of a ledger of teacher queries.
METHOD = "pate_queries"


def sensitivity(teachers_per_phrase: int = 1) -> float:
  """L2 sensitivity of the teacher sum when `teachers_per_phrase` teachers
  change (1: sample level)."""
  if int(teachers_per_phrase) != teachers_per_phrase or teachers_per_phrase < 1:
    raise ValueError(f"teachers_per_phrase must be an integer >= 1, "
                     f"got {teachers_per_phrase}.")
  return SAMPLE_SENSITIVITY * teachers_per_phrase


def query_event(sigma: float, count: int,
                teachers_per_phrase: int = 1) -> accounting.Gaussian:
  """`count` answered queries with noise std `sigma` on the teacher sum."""
  return accounting.Gaussian(sigma / sensitivity(teachers_per_phrase), count)


def calibrate_sigma(target_epsilon: float, max_queries: int, *,
                    delta: float = DELTA, teachers_per_phrase: int = 1,
                    accountant: str = "rdp") -> float:
  """The smallest noise std on the teacher sum for which `max_queries`
  queries cost at most `target_epsilon` at `delta`."""
  multiplier = accounting.calibrate_noise_multiplier(
      target_epsilon, delta,
      lambda s: [accounting.Gaussian(s, max_queries)], accountant)
  return multiplier * sensitivity(teachers_per_phrase)


def make_ledger(target_epsilon: float, max_queries: int, *,
                num_teachers: int, dataset_size: int,
                sigma: float | None = None, delta: float = DELTA,
                teachers_per_phrase: int = 1,
                accountant: str = "rdp") -> ledger_lib.PrivacyLedger:
  """An empty ledger of teacher queries; sigma calibrated unless given.

  The ledger holds everything the aggregator needs: `noise_multiplier *
  clip_norm` is sigma, `clip_norm` the sensitivity, and `sampling` names the
  query budget (`max_queries`) and the number of teachers.
  """
  if int(max_queries) != max_queries or max_queries < 1:
    raise ValueError(f"max_queries must be an integer >= 1, got {max_queries}.")
  if sigma is None:
    sigma = calibrate_sigma(target_epsilon, max_queries, delta=delta,
                            teachers_per_phrase=teachers_per_phrase,
                            accountant=accountant)
  ledger = ledger_lib.PrivacyLedger(
      accountant=accountant,
      sampling={"method": METHOD, "max_queries": int(max_queries),
                "num_teachers": int(num_teachers),
                "teachers_per_phrase": int(teachers_per_phrase)},
      noise_multiplier=sigma / sensitivity(teachers_per_phrase),
      clip_norm=sensitivity(teachers_per_phrase),
      dataset_size=int(dataset_size), delta=delta,
      target_epsilon=target_epsilon)
  ledger.check_budget([accounting.Gaussian(ledger.noise_multiplier,
                                           max_queries)])
  return ledger


def ledger_sigma(ledger: ledger_lib.PrivacyLedger) -> float:
  """The noise std on the teacher sum of a `make_ledger` ledger."""
  if ledger.sampling.get("method") != METHOD:
    raise ValueError(f"not a ledger of teacher queries: sampling "
                     f"{ledger.sampling}")
  return ledger.noise_multiplier * ledger.clip_norm


def phrase_epsilons(sigma: float, queries: int,
                    teacher_counts: np.ndarray, *, delta: float = DELTA,
                    accountant: str = "rdp") -> np.ndarray:
  """Epsilon of each phrase after `queries` queries, from the number of
  teachers holding it (`partition.phrase_teacher_counts`; 0: the phrase is
  in no teacher's data, epsilon 0)."""
  counts = np.asarray(teacher_counts, np.int64)
  out = np.zeros(counts.shape, np.float64)
  for n_s in np.unique(counts[counts > 0]):  # one accountant call per n_s
    out[counts == n_s] = accounting.epsilon(
        [query_event(sigma, queries, int(n_s))], delta, accountant)
  return out


def summarize_phrase_epsilons(epsilons: np.ndarray,
                              teacher_counts: np.ndarray) -> dict:
  """min / avg / max epsilon over the phrases that occur in the private data
  (paper Table 6), and the distribution of teachers per phrase (Table 5)."""
  counts = np.asarray(teacher_counts)
  held = np.asarray(epsilons)[counts > 0]
  if held.size == 0:
    raise ValueError("no phrase occurs in the private data.")
  values, freq = np.unique(counts[counts > 0], return_counts=True)
  return {"phrases": int(held.size), "epsilon_min": float(held.min()),
          "epsilon_avg": float(held.mean()), "epsilon_max": float(held.max()),
          "fraction_below_avg": float(np.mean(held < held.mean())),
          "teachers_per_phrase": {int(v): int(f) for v, f in zip(values, freq)}}
