"""SeqPATE's noisy teacher aggregation: each answer is noised once and stored.

A query is a (sentence s, position j) of the pseudo-data together with the
student's candidate set there (its top-p 0.95 or top-k tokens,
`candidate_sets`, padded with -1 to a fixed width C). The answer (paper
Sec. 4.2, with the noise on the sum as in its Sec. 5.2 analysis; the
paper's 1/M factor cancels in the renormalisation):

    noisy_v = a(v | s, j) + scale * Z(s, j, v)   for each candidate v
    answer  = max(noisy, 0) / sum(max(noisy, 0))  over the candidates

where the aggregate a is the teachers' summed top-k distributions (p_m is 0
outside teacher m's top-k, see `dpjax.pipelines.seqpate.cache`) or, for the paper's
-Merge_P ablation, the histogram of their top-1 votes; Z is N(0, 1) (scale
sigma) or, for the paper's -Gaussian ablation, standard Laplace (density
exp(-|z|) / 2, scale b). Which aggregate, noise and scale: the ledger's
(`accounting.make_ledger`). If every candidate is clipped to 0, the answer
is uniform over the candidates. `Aggregator.answer` handles many queries at
once (vectorised, no loop per query) and keeps every answer in an
`AnswerStore`: asking again for an (s, j) returns the stored answer
bit-for-bit, with the candidate set it was first answered for, never a fresh
draw.

Formal guarantees
-----------------
* Z(s, j, v) comes from a counter-based PRNG keyed by (secret, s, j, v),
  independent across distinct triples. Every answer ever computed at (s, j),
  whatever its candidate set, is therefore a function of one Gaussian (or
  Laplace) mechanism over the whole vocabulary, `a + scale Z(s, j, .)`, with
  L2 sensitivity sqrt(2) (L1 sensitivity 2; `dpjax.pipelines.seqpate.accounting`);
  restricting it to candidates chosen before the draw (from public data and
  earlier answers) is post-processing. Storing answers additionally makes
  each (s, j) a single release the student can reuse for free.
* Clipping negatives, renormalising and the uniform fallback read only the
  noisy values and the candidate set: post-processing.
* Before drawing noise, `answer` refuses with `BudgetExceededError` a request
  whose new (s, j) would take the recorded queries past the ledger's
  `max_queries` or its epsilon past the target; new answers are recorded in
  the ledger (`accounting.query_event`) before they are returned.
* As with all of dpjax's noise, the key is the run's secret
  (`dpjax.privacy.secret`: OS entropy, kept in the answers' directory as
  `secret_key.json`, never published), threefry is taken for a
  pseudorandom function and PRNG floats for exact Gaussian / Laplace draws.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.generation import decoding
from dpjax import fileio
from dpjax.privacy import ledger as ledger_lib
from dpjax.privacy import noise as noise_lib
from dpjax.privacy import secret as secret_lib
from dpjax.pipelines.seqpate import accounting
from dpjax.pipelines.seqpate.cache import TeacherSums

# Separates the aggregation noise stream from any other use of the secret.
NOISE_STREAM_CONSTANT = 0x70617465  # "pate"
ANSWERS_FILENAME = "teacher_answers.npz"


@functools.partial(jax.jit, static_argnames=("mechanism",))
def _noise(secret, sentences, positions, candidates, *, mechanism):
  draw = (noise_lib.standard_laplace if mechanism == "laplace"
          else noise_lib.standard_normal)

  def one(s, j, v):
    return draw(noise_lib.stream_keys(secret, NOISE_STREAM_CONSTANT, s, j, v),
                ())

  return jax.vmap(jax.vmap(one, (None, None, 0)))(sentences, positions,
                                                  candidates)


@functools.partial(jax.jit, static_argnames=("max_candidates", "use_top_k",
                                             "use_top_p"))
def _candidates(logits, top_k, top_p, *, max_candidates, use_top_k,
                use_top_p):
  if use_top_k:
    logits = decoding.top_k_filter(logits, top_k)
  if use_top_p:
    logits = decoding.top_p_filter(logits, top_p)
  values, ids = jax.lax.top_k(logits, max_candidates)
  return jnp.where(jnp.isfinite(values), ids, -1)


def candidate_sets(student_logits, *, max_candidates: int, top_p: float = 1.0,
                   top_k: int = 0) -> np.ndarray:
  """The student's candidate sets `[Q, max_candidates]` (-1 padded), most
  likely first: its top-k tokens (k > 0) and/or its top-p nucleus (p < 1),
  as in `decoding`'s sampling filters (paper Sec. 4.3: top-p 0.95). A set
  larger than `max_candidates` keeps the `max_candidates` most likely."""
  logits = jnp.asarray(student_logits, jnp.float32)
  if not 1 <= max_candidates <= logits.shape[-1]:
    raise ValueError(f"max_candidates must be in [1, {logits.shape[-1]}], "
                     f"got {max_candidates}.")
  return np.asarray(_candidates(
      logits, jnp.int32(top_k), jnp.float32(top_p),
      max_candidates=max_candidates, use_top_k=top_k > 0,
      use_top_p=top_p < 1.0))


def standard_noise(secret: secret_lib.RunSecret, sentences: np.ndarray,
                   positions: np.ndarray, candidates: np.ndarray,
                   mechanism: str = "gaussian") -> np.ndarray:
  """`[Q, C]` draws Z(secret, s, j, v), N(0, 1) ("gaussian") or standard
  Laplace, density exp(-|z|) / 2 ("laplace"); 0 where a candidate is -1.

  Q is padded to a power of two, so few shapes are ever compiled.
  """
  if mechanism not in accounting.MECHANISMS:
    raise ValueError(f"mechanism must be one of {accounting.MECHANISMS}, got "
                     f"{mechanism!r}.")
  q = len(sentences)
  padded = max(16, 1 << (q - 1).bit_length())
  pad = lambda x: np.concatenate(
      [np.asarray(x, np.int32), np.zeros((padded - q,) + np.shape(x)[1:],
                                         np.int32)])
  z = _noise(secret.noise_key("seqpate-aggregation"), pad(sentences),
             pad(positions),
             pad(np.maximum(candidates, 0)), mechanism=mechanism)
  return np.where(np.asarray(candidates) >= 0, np.asarray(z)[:q], 0.0)


def normalize(noisy: np.ndarray, valid: np.ndarray) -> np.ndarray:
  """Negatives clipped to 0, renormalised over the valid candidates; uniform
  over them where nothing positive is left."""
  clipped = np.where(valid, np.maximum(noisy, 0.0), 0.0)
  total = clipped.sum(-1, keepdims=True)
  uniform = valid / valid.sum(-1, keepdims=True)
  return np.where(total > 0, clipped / np.where(total > 0, total, 1.0),
                  uniform)


@dataclasses.dataclass
class AnswerStore:
  """Answered queries: `keys` (s * num_positions + j, sorted) with their
  candidate sets `[n, C]` (-1 padded) and answers `[n, C]` float32, on the
  pseudo-data with `fingerprint` (`dpjax.pipelines.seqpate.cache.fingerprint`)."""
  fingerprint: str
  num_positions: int
  keys: np.ndarray
  candidates: np.ndarray
  probs: np.ndarray

  @classmethod
  def empty(cls, fingerprint: str, num_positions: int,
            width: int) -> AnswerStore:
    """A store with no answers, for candidate sets `width` wide."""
    return cls(fingerprint, num_positions, np.zeros(0, np.int64),
               np.zeros((0, width), np.int32), np.zeros((0, width), np.float32))

  def __len__(self) -> int:
    return len(self.keys)

  @property
  def width(self) -> int:
    """C, the candidates of each answer."""
    return self.candidates.shape[1]

  def find(self, keys: np.ndarray) -> np.ndarray:
    """Row of each key in the store, -1 where it has no answer."""
    if not len(self):
      return np.full(len(keys), -1)
    at = np.minimum(np.searchsorted(self.keys, keys), len(self) - 1)
    return np.where(self.keys[at] == keys, at, -1)

  def add(self, keys: np.ndarray, candidates: np.ndarray,
          probs: np.ndarray) -> None:
    """Adds the answers of new `keys`, keeping the store sorted by key.

    Raises:
      ValueError: a key is already answered, or given twice.
    """
    if (self.find(keys) >= 0).any() or len(np.unique(keys)) != len(keys):
      raise ValueError("a query is answered at most once.")
    keys = np.concatenate([self.keys, keys])
    order = np.argsort(keys, kind="stable")
    self.keys = keys[order]
    self.candidates = np.concatenate([self.candidates, candidates])[order]
    self.probs = np.concatenate([self.probs, probs.astype(np.float32)])[order]

  def save(self, path: str) -> None:
    """Writes the store atomically (temp file, then rename)."""
    with fileio.open_atomic(path, "wb") as f:
      np.savez(f, fingerprint=np.array(self.fingerprint),
               num_positions=np.array(self.num_positions),
               keys=self.keys, candidates=self.candidates, probs=self.probs)

  @classmethod
  def load(cls, path: str) -> AnswerStore:
    """Reads a store written by `save`."""
    with np.load(path) as f:
      return cls(str(f["fingerprint"]), int(f["num_positions"]), f["keys"],
                 f["candidates"], f["probs"])


@dataclasses.dataclass(frozen=True)
class Answers:
  """Per requested query: the candidate set answered for (`[Q, C]`, -1
  padded), the aggregated distribution over it (`[Q, C]`, sums to 1) and
  whether its noise was drawn by this call (`[Q]`)."""
  candidates: np.ndarray
  probs: np.ndarray
  fresh: np.ndarray


def _queries_recorded(ledger: ledger_lib.PrivacyLedger) -> int:
  return sum(e.count for e in ledger.events)


class Aggregator:
  """Answers teacher queries under a ledger (`accounting.make_ledger`),
  with noise keyed by the run's `secret` (kept with the answers by `save`)."""

  def __init__(self, sums: TeacherSums, ledger: ledger_lib.PrivacyLedger, *,
               secret: secret_lib.RunSecret, max_candidates: int,
               store: AnswerStore | None = None):
    self.sums = sums
    self.ledger = ledger
    self.setup = accounting.ledger_setup(ledger)
    self.scale = self.setup.scale
    self.max_queries = self.setup.max_queries
    self.secret = secret
    ledger.secret = secret.source
    if self.setup.num_teachers != sums.num_teachers:
      raise ValueError(f"ledger is for {self.setup.num_teachers} teachers, "
                       f"the cache holds {sums.num_teachers}.")
    if self.setup.aggregate != sums.aggregate:
      raise ValueError(f"ledger is for the teachers' {self.setup.aggregate}, "
                       f"the sums are of their {sums.aggregate}.")
    self.store = store or AnswerStore.empty(sums.fingerprint,
                                            sums.num_positions, max_candidates)
    if (self.store.fingerprint, self.store.width) != (sums.fingerprint,
                                                      max_candidates):
      raise ValueError("stored answers are for other pseudo-data or another "
                       "max_candidates.")
    if len(self.store) > _queries_recorded(ledger):
      raise ValueError(f"{len(self.store)} stored answers but only "
                       f"{_queries_recorded(ledger)} queries in the ledger.")

  @property
  def remaining(self) -> int:
    """Queries left in the budget."""
    return self.max_queries - _queries_recorded(self.ledger)

  def _check(self, sentences, positions, candidates) -> np.ndarray:
    if sentences.ndim != 1 or sentences.shape != positions.shape:
      raise ValueError(f"sentences {sentences.shape} and positions "
                       f"{positions.shape} must be equal 1-D shapes.")
    if candidates.ndim != 2 or len(candidates) != len(sentences):
      raise ValueError(f"candidates {candidates.shape} must be [Q, C] with "
                       f"Q = {len(sentences)}.")
    if candidates.shape[1] > self.store.width:
      raise ValueError(f"{candidates.shape[1]} candidates per query exceed "
                       f"max_candidates {self.store.width}.")
    if ((sentences < 0) | (sentences >= self.sums.num_sentences)).any() or (
        (positions < 0) | (positions >= self.sums.num_positions)).any():
      raise ValueError("a (sentence, position) is outside the pseudo-data.")
    if ((candidates < -1) | (candidates >= self.sums.vocab_size)).any():
      raise ValueError("candidate ids must be token ids or -1 (padding).")
    if not (candidates >= 0).any(-1).all():
      raise ValueError("every query needs at least one candidate.")
    ordered = np.sort(candidates, -1)
    if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any():
      raise ValueError("a candidate set repeats a token.")
    return np.pad(candidates, ((0, 0), (0, self.store.width
                                        - candidates.shape[1])),
                  constant_values=-1)

  def answer(self, sentences, positions, candidates) -> Answers:
    """Answers `[Q]` (sentence, position) queries for `[Q, C']` candidate
    sets (C' <= max_candidates, -1 padded, no repeated token in a row).

    Queries answered before (in this or an earlier call, or a loaded store)
    return their stored answer and candidate set and cost nothing; the new
    ones are charged to the ledger, all or none: if they do not fit in the
    budget, `BudgetExceededError` is raised and nothing is drawn.
    """
    sentences = np.asarray(sentences, np.int64)
    positions = np.asarray(positions, np.int64)
    candidates = self._check(sentences, positions,
                             np.asarray(candidates, np.int64))
    keys = sentences * self.sums.num_positions + positions
    new = self.store.find(keys) < 0
    new_keys, first = np.unique(keys[new], return_index=True)
    if len(new_keys):
      if len(new_keys) > self.remaining:
        raise ledger_lib.BudgetExceededError(
            f"{len(new_keys)} new teacher queries but only {self.remaining} "
            f"of the budget of {self.max_queries} are left.")
      event = accounting.query_event(self.scale, len(new_keys),
                                     self.setup.teachers_per_phrase,
                                     self.setup.mechanism)
      self.ledger.check_budget([event])
      rows = np.flatnonzero(new)[first]
      cand = candidates[rows]
      noisy = self.sums.restricted(sentences[rows], positions[rows], cand) + (
          self.scale * standard_noise(self.secret, sentences[rows],
                                      positions[rows], cand,
                                      self.setup.mechanism))
      probs = normalize(noisy, cand >= 0)
      self.ledger.record(event)
      self.store.add(new_keys, cand.astype(np.int32), probs)
    at = self.store.find(keys)
    return Answers(self.store.candidates[at], self.store.probs[at], new)

  def save(self, directory: str) -> None:
    """Writes the secret (once), the ledger, then the answers (so a crash in
    between can only over-count queries, never forget one)."""
    os.makedirs(directory, exist_ok=True)
    if not secret_lib.exists(directory):
      self.secret.save(directory)
    self.ledger.save(os.path.join(directory, ledger_lib.LEDGER_FILENAME))
    self.store.save(os.path.join(directory, ANSWERS_FILENAME))

  @classmethod
  def restore(cls, directory: str, sums: TeacherSums, *,
              max_candidates: int) -> Aggregator:
    """The aggregator saved by `save` in `directory`, with its secret."""
    ledger = ledger_lib.PrivacyLedger.load(
        os.path.join(directory, ledger_lib.LEDGER_FILENAME))
    store = AnswerStore.load(os.path.join(directory, ANSWERS_FILENAME))
    return cls(sums, ledger, secret=secret_lib.RunSecret.load(directory),
               max_candidates=max_candidates, store=store)
