"""Privacy accounting of SeqPATE's teacher queries, as `dpjax.privacy` events.

One query is one answered (sentence, position) of the pseudo-data: a vector
over the vocabulary aggregated from the teachers plus independent noise on
each coordinate (`dpjax.pipelines.seqpate.aggregation`). The aggregate is

* "distribution" (SeqPATE): the sum of the teachers' top-k next-token
  distributions, or
* "votes" (the paper's -Merge_P ablation, original PATE): the histogram of
  the teachers' top-1 tokens;

and the noise is

* "gaussian" (SeqPATE): N(0, scale^2), scale = sigma, or
* "laplace" (the paper's -Gaussian ablation, original PATE): Laplace with
  density exp(-|x| / b) / (2b), scale = b.

A run has a budget of Q queries; `scale` is the noise on the aggregate (the
sum, not the mean, of the teachers).

Formal guarantees
-----------------
* Sample level. Each private example is in exactly one teacher's partition,
  and the partition does not depend on the examples' content
  (`dpjax.pipelines.seqpate.partition`), so under replace-one adjacency changing one
  example changes one teacher. A teacher contributes a sub-probability
  vector x (its top-k probabilities, every other token 0: x >= 0,
  sum(x) <= 1; a vote is the point mass at its top-1 token, a special case),
  so the aggregate changes by x - x' with ||x - x'||_1 <= 2 and
  ||x - x'||_inf <= 1, hence ||x - x'||_2 <= sqrt(||.||_1 ||.||_inf) <= sqrt(2)
  (paper Sec. 5.2, App. C; disjoint point masses, e.g. one flipped vote,
  reach both bounds). A Gaussian query is a Gaussian mechanism with noise
  multiplier sigma / sqrt(2), a Laplace query a Laplace mechanism with
  multiplier b / 2 (pure (2 / b)-DP). Q queries, chosen adaptively by the
  student, compose as `Gaussian(sigma / sqrt(2), Q)` (paper Lemma 5.2) or
  `Laplace(b / 2, Q)`, accounted by dp-accounting.
* The candidate set restricts which coordinates are released. It is chosen
  by the student from public data and earlier answers, before this query's
  noise is drawn, so releasing a subset of the coordinates is
  post-processing: a sub-vector's L1 and L2 norms are at most the vector's.
* Phrase level (paper Sec. 5.3, App. D). Neighbouring datasets differ in the
  occurrences of one secret phrase s; with a partition that depends only on
  user ids, only the n_s teachers holding s change, each by a
  sub-probability vector, so the aggregate changes by at most sqrt(2) n_s in
  L2 and 2 n_s in L1 (triangle inequality; n_s disjoint point masses reach
  them). The phrase's guarantee is the run's events with their noise
  multipliers divided by n_s (`phrase_epsilons`): epsilon grows with n_s,
  which `user_partition` keeps near 1.
* `calibrate_noise` returns a scale whose epsilon is <= the target (within
  1%, `dpjax.privacy.accounting.calibrate_noise_multiplier`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from dpjax.privacy import accounting
from dpjax.privacy import ledger as ledger_lib

# Sensitivity of the aggregate to one teacher: L2 for Gaussian noise, L1 for
# Laplace noise.
SAMPLE_SENSITIVITY = {"gaussian": math.sqrt(2.0), "laplace": 2.0}
MECHANISMS = tuple(SAMPLE_SENSITIVITY)
AGGREGATES = ("distribution", "votes")
DELTA = 1e-5  # the paper's delta
# `PrivacyLedger.sampling["method"]` of a ledger of teacher queries.
METHOD = "pate_queries"
_EVENTS = {"gaussian": accounting.Gaussian, "laplace": accounting.Laplace}


def _check_mechanism(mechanism: str) -> None:
  if mechanism not in MECHANISMS:
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got "
                     f"{mechanism!r}.")


def sensitivity(teachers_per_phrase: int = 1,
                mechanism: str = "gaussian") -> float:
  """Sensitivity of the aggregate when `teachers_per_phrase` teachers change
  (1: sample level): L2 for "gaussian", L1 for "laplace"."""
  _check_mechanism(mechanism)
  if int(teachers_per_phrase) != teachers_per_phrase or teachers_per_phrase < 1:
    raise ValueError(f"teachers_per_phrase must be an integer >= 1, "
                     f"got {teachers_per_phrase}.")
  return SAMPLE_SENSITIVITY[mechanism] * teachers_per_phrase


def query_event(scale: float, count: int, teachers_per_phrase: int = 1,
                mechanism: str = "gaussian") -> accounting.Event:
  """`count` answered queries with noise `scale` (sigma or b) on the
  aggregate."""
  return _EVENTS[mechanism](
      scale / sensitivity(teachers_per_phrase, mechanism), count)


def calibrate_noise(target_epsilon: float, max_queries: int, *,
                    delta: float = DELTA, teachers_per_phrase: int = 1,
                    mechanism: str = "gaussian",
                    accountant: str = "rdp") -> float:
  """The smallest noise scale on the aggregate (sigma, or the Laplace b) for
  which `max_queries` queries cost at most `target_epsilon` at `delta`."""
  _check_mechanism(mechanism)
  multiplier = accounting.calibrate_noise_multiplier(
      target_epsilon, delta,
      lambda s: [_EVENTS[mechanism](s, max_queries)], accountant)
  return multiplier * sensitivity(teachers_per_phrase, mechanism)


def make_ledger(target_epsilon: float, max_queries: int, *,
                num_teachers: int, dataset_size: int,
                scale: float | None = None, delta: float = DELTA,
                teachers_per_phrase: int = 1, mechanism: str = "gaussian",
                aggregate: str = "distribution",
                accountant: str = "rdp") -> ledger_lib.PrivacyLedger:
  """An empty ledger of teacher queries; the noise scale calibrated unless
  given.

  The ledger holds everything the aggregator needs: `noise_multiplier *
  clip_norm` is the scale, `clip_norm` the sensitivity, and `sampling` names
  the query budget (`max_queries`), the number of teachers, the mechanism
  and the aggregate.
  """
  _check_mechanism(mechanism)
  if aggregate not in AGGREGATES:
    raise ValueError(f"aggregate must be one of {AGGREGATES}, got "
                     f"{aggregate!r}.")
  if int(max_queries) != max_queries or max_queries < 1:
    raise ValueError(f"max_queries must be an integer >= 1, got {max_queries}.")
  if scale is None:
    scale = calibrate_noise(target_epsilon, max_queries, delta=delta,
                            teachers_per_phrase=teachers_per_phrase,
                            mechanism=mechanism, accountant=accountant)
  bound = sensitivity(teachers_per_phrase, mechanism)
  ledger = ledger_lib.PrivacyLedger(
      accountant=accountant,
      sampling={"method": METHOD, "max_queries": int(max_queries),
                "num_teachers": int(num_teachers),
                "teachers_per_phrase": int(teachers_per_phrase),
                "mechanism": mechanism, "aggregate": aggregate},
      noise_multiplier=scale / bound, clip_norm=bound,
      dataset_size=int(dataset_size), delta=delta,
      target_epsilon=target_epsilon)
  ledger.check_budget([query_event(scale, max_queries, teachers_per_phrase,
                                   mechanism)])
  return ledger


@dataclasses.dataclass(frozen=True)
class QuerySetup:
  """What a ledger of teacher queries says about its answers."""
  mechanism: str
  aggregate: str
  scale: float
  teachers_per_phrase: int
  max_queries: int
  num_teachers: int


def ledger_setup(ledger: ledger_lib.PrivacyLedger) -> QuerySetup:
  """The `QuerySetup` of a `make_ledger` ledger (ledgers written before the
  mechanism and aggregate were recorded are Gaussian on distributions)."""
  sampling = ledger.sampling
  if sampling.get("method") != METHOD:
    raise ValueError(f"not a ledger of teacher queries: sampling {sampling}")
  return QuerySetup(
      sampling.get("mechanism", "gaussian"),
      sampling.get("aggregate", "distribution"),
      ledger.noise_multiplier * ledger.clip_norm,
      int(sampling["teachers_per_phrase"]), int(sampling["max_queries"]),
      int(sampling["num_teachers"]))


def phrase_epsilons(ledger: ledger_lib.PrivacyLedger,
                    teacher_counts: np.ndarray) -> np.ndarray:
  """Epsilon of each phrase for the queries recorded in a `make_ledger`
  ledger, from the number of teachers holding it
  (`partition.phrase_teacher_counts`; 0: the phrase is in no teacher's data,
  epsilon 0): the ledger's events with their multipliers scaled from its
  `teachers_per_phrase` to n_s."""
  held_by = ledger_setup(ledger).teachers_per_phrase
  counts = np.asarray(teacher_counts, np.int64)
  out = np.zeros(counts.shape, np.float64)
  for n_s in np.unique(counts[counts > 0]):  # one accountant call per n_s
    events = [dataclasses.replace(
        e, noise_multiplier=e.noise_multiplier * held_by / n_s)
              for e in ledger.all_events]
    out[counts == n_s] = accounting.epsilon(events, ledger.delta,
                                            ledger.accountant)
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
