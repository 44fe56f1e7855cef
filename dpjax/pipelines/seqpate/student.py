"""The SeqPATE student (paper Sec. 4.3, App. B): warm-up on the pseudo-data,
then knowledge distillation from the noisy teacher aggregate on hard tokens.

Both phases run one jitted step over fixed-shape batches of the pseudo-data
(`[B, L]` rows; the last batch of an epoch is padded with zero-weight rows).
Position j of a row predicts token j + 1 (the convention of the teacher
cache). The step's loss (paper Eq. 4, both sums over the batch's pseudo
tokens, divided by their number):

    L = sum_j w_j (-log p_s(x_{j+1} | x_{<=j}))
        + lambda * sum_{j answered} KL(p_agg(. | j) || q_s(. | j))

where q_s is the student's distribution restricted to the answer's candidate
set and renormalised over it (softmax of the student's logits at the
candidates; the paper renormalises both distributions over the kept words),
and p_agg the aggregator's answer over that set. `distill="top1"` replaces
the KL by -log q_s(argmax p_agg) (the paper's "-KL" ablation: cross-entropy
with the teachers' top-1); `distill="none"` trains on the pseudo labels only.

Hard tokens (efficient KD): the paper queries the teachers where "the student
cannot imitate the pseudo-label", read as: the pseudo label is not among the
student's `hard_threshold` most likely tokens (its 0-based rank, the number of
tokens with a strictly larger logit, is >= the threshold; App. G uses 5 or
10). Only hard positions not answered before are sent to the aggregator, and
only as many as the query budget has left; once it is spent no new query is
made. Every position that has a stored answer (from this step or any earlier
one) gets the teacher term: reusing an answer costs nothing.

Host-side bookkeeping (which positions to query) is numpy over the whole
batch; no loop over tokens.

Formal guarantees
-----------------
* The student touches private data only through `Aggregator.answer`, which
  charges every new (sentence, position) to the ledger before returning it
  and refuses past the budget. Which positions are queried and their
  candidate sets depend only on the student (public pseudo-data and earlier
  answers): post-processing. The student's own training adds no privacy
  cost; the ledger's epsilon is the whole run's.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.models import gpt2, losses
from dpjax.pipelines.seqpate import aggregation
from dpjax.pipelines.seqpate import cache as cache_lib

DISTILL = ("kl", "top1", "none")


@dataclasses.dataclass(frozen=True)
class StudentSetup:
  """How the student trains. Candidates: top-p (`top_p` < 1), top-k
  (`top_k` > 0), or, with neither, the whole vocabulary (no filtering), at
  most the aggregator's `max_candidates` of them."""
  batch_size: int
  warmup_epochs: int
  kd_epochs: int
  learning_rate: float
  lam: float = 20.0
  hard_threshold: int = 5
  top_p: float = 0.95
  top_k: int = 0
  distill: str = "kl"
  seed: int = 0

  def __post_init__(self):
    if self.distill not in DISTILL:
      raise ValueError(f"distill must be one of {DISTILL}, got "
                       f"{self.distill!r}")
    if self.hard_threshold < 0:
      raise ValueError(f"hard_threshold must be >= 0, got "
                       f"{self.hard_threshold}")


def pseudo_label_ranks(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """0-based rank of each target under `logits` `[..., V]`: the number of
  tokens with a strictly larger logit."""
  target_logit = jnp.take_along_axis(logits, targets[..., None], -1)
  return (logits > target_logit).sum(-1)


def teacher_terms(logits: jax.Array, candidates: jax.Array, probs: jax.Array,
                  distill: str) -> jax.Array:
  """`[...]` per-position teacher loss: KL(p_agg || q_s) (`"kl"`) or
  -log q_s(argmax p_agg) (`"top1"`), q_s = softmax of `logits [..., V]`
  restricted to `candidates [..., C]` (-1 = padding) and renormalised."""
  valid = candidates >= 0
  at = jnp.take_along_axis(logits.astype(jnp.float32),
                           jnp.maximum(candidates, 0), -1)
  log_q = jax.nn.log_softmax(jnp.where(valid, at, -jnp.inf), -1)
  log_q = jnp.where(valid, log_q, 0.0)
  if distill == "top1":
    top = jnp.argmax(jnp.where(valid, probs, -1.0), -1)
    return -jnp.take_along_axis(log_q, top[..., None], -1)[..., 0]
  p = jnp.where(valid, probs, 0.0)
  log_p = jnp.log(jnp.where(p > 0, p, 1.0))
  return (p * (log_p - log_q)).sum(-1)


@functools.lru_cache(maxsize=None)
def make_step(config: gpt2.GPT2Config, learning_rate: float, *, lam: float,
              distill: str) -> Callable:
  """`step(params, opt_state, tokens, weights, kd_candidates, kd_probs,
  kd_mask, rng) -> (params, opt_state, loss)`: one Adam update on Eq. 4.

  tokens, weights: `[B, L]`; kd_candidates / kd_probs: `[B, L-1, C]` (-1 /
  anything where unused); kd_mask `[B, L-1]`: 1 where position j has a
  teacher answer. Jitted once per shape; cached per arguments, so students
  of the same configuration share the compilation.
  """
  optimizer = optax.adam(learning_rate)
  model = gpt2.GPT2(config)
  dropout = config.dropout_rate > 0

  def loss_fn(params, tokens, weights, cands, probs, mask, rng):
    logits = model.apply({"params": params}, tokens, enable_dropout=dropout,
                         rngs={"dropout": rng} if dropout else {})[:, :-1]
    w = weights[:, 1:]
    pseudo = (losses.token_cross_entropy(logits, tokens[:, 1:]) * w).sum()
    if distill == "none":
      teacher = 0.0
    else:
      teacher = (teacher_terms(logits, cands, probs, distill) * mask).sum()
    return (pseudo + lam * teacher) / jnp.maximum(w.sum(), 1.0)

  def step(params, opt_state, tokens, weights, cands, probs, mask, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, weights, cands,
                                              probs, mask, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=None)
def make_analyse(config: gpt2.GPT2Config) -> Callable:
  """`analyse(params, tokens [B, L]) -> (logits [B, L-1, V], ranks [B,
  L-1])`: the student's next-token logits and the pseudo labels' ranks."""
  model = gpt2.GPT2(config)

  def analyse(params, tokens):
    logits = model.apply({"params": params}, tokens)[:, :-1]
    return logits, pseudo_label_ranks(logits, tokens[:, 1:])

  return jax.jit(analyse)


def epoch_batches(num_rows: int, batch_size: int, *, seed: int,
                  epoch: int) -> np.ndarray:
  """`[S, batch_size]` row indices of one shuffled epoch (-1 = padding)."""
  order = np.random.default_rng((seed, epoch)).permutation(num_rows)
  padded = np.full(-(-num_rows // batch_size) * batch_size, -1, np.int64)
  padded[:num_rows] = order
  return padded.reshape(-1, batch_size)


@dataclasses.dataclass
class KDStats:
  """Per KD epoch: new (charged) queries, and positions trained with a
  teacher term (stored answers included, every visit counted)."""
  new_queries: list[int] = dataclasses.field(default_factory=list)
  distilled_positions: list[int] = dataclasses.field(default_factory=list)
  hard_positions: list[int] = dataclasses.field(default_factory=list)


class Student:
  """Trains a student from `init_params` on the pseudo-data `{"tokens",
  "loss_weights"}` (`pseudo_data.complete_prefixes`): `warmup()`, then
  `distill(aggregator)`."""

  def __init__(self, config: gpt2.GPT2Config, init_params, pseudo: dict,
               setup: StudentSetup):
    self.config = config
    self.setup = setup
    self.tokens = np.asarray(pseudo["tokens"], np.int32)
    self.weights = np.asarray(pseudo["loss_weights"], np.float32)
    self.params = jax.tree.map(jnp.array, init_params)  # owned: donated
    self.opt_state = optax.adam(setup.learning_rate).init(self.params)
    self._analyse = make_analyse(config)
    self._rng = jax.random.key(setup.seed)
    self._count = 0

  def _step(self, distill, tokens, weights, cands, probs, mask):
    step = make_step(self.config, self.setup.learning_rate,
                     lam=self.setup.lam, distill=distill)
    rng = jax.random.fold_in(self._rng, self._count)
    self._count += 1
    self.params, self.opt_state, loss = step(
        self.params, self.opt_state, tokens, weights, cands, probs, mask, rng)
    return loss

  def _batch(self, index):
    rows = np.maximum(index, 0)
    return self.tokens[rows], self.weights[rows] * (index >= 0)[:, None]

  def warmup(self, log: Callable[[str], None] = print) -> None:
    """`warmup_epochs` of the pseudo-label loss alone."""
    b, length = self.setup.batch_size, self.tokens.shape[1]
    empty = (np.full((b, length - 1, 1), -1, np.int32),
             np.zeros((b, length - 1, 1), np.float32),
             np.zeros((b, length - 1), np.float32))
    for epoch in range(self.setup.warmup_epochs):
      total = [self._step("none", *self._batch(index), *empty)
               for index in epoch_batches(len(self.tokens), b,
                                          seed=self.setup.seed, epoch=epoch)]
      log(f"student warm-up epoch {epoch}: loss "
          f"{float(np.mean(jax.device_get(total))):.4f}")

  def distill(self, aggregator: aggregation.Aggregator | None,
              log: Callable[[str], None] = print) -> KDStats:
    """`kd_epochs` of Eq. 4 with answers from `aggregator` (over this
    pseudo-data; None only with `distill="none"`)."""
    setup = self.setup
    if (aggregator is None) != (setup.distill == "none"):
      raise ValueError("an aggregator is needed exactly when distill is not "
                       "'none'.")
    if aggregator is not None and (aggregator.sums.fingerprint
                                   != cache_lib.fingerprint(self.tokens)):
      raise ValueError("the aggregator's teacher cache is for other "
                       "pseudo-data.")
    b, length = setup.batch_size, self.tokens.shape[1]
    width = aggregator.store.width if aggregator is not None else 1
    stats = KDStats()
    # Every (row, position) of a batch, flattened in row-major order.
    positions = np.tile(np.arange(length - 1), b)
    for epoch in range(setup.kd_epochs):
      new_total = distilled = hard_total = 0
      losses_ = []
      for index in epoch_batches(len(self.tokens), b, seed=setup.seed,
                                 epoch=setup.warmup_epochs + epoch):
        tokens, weights = self._batch(index)
        cands = np.full((b * (length - 1), width), -1, np.int32)
        probs = np.zeros((b * (length - 1), width), np.float32)
        mask = np.zeros(b * (length - 1), np.float32)
        if aggregator is not None:
          new, answered, student_sets = self._queries(aggregator, tokens,
                                                      weights, positions,
                                                      index)
          hard_total += int(new.sum())
          fits = new & (np.cumsum(new) <= aggregator.remaining)
          ask = fits | answered
          if ask.any():
            sentences = np.repeat(np.maximum(index, 0), length - 1)
            answers = aggregator.answer(sentences[ask], positions[ask],
                                        student_sets[ask])
            new_total += int(answers.fresh.sum())
            cands[ask], probs[ask], mask[ask] = (answers.candidates,
                                                 answers.probs, 1.0)
            distilled += int(ask.sum())
        losses_.append(self._step(
            setup.distill, tokens, weights,
            cands.reshape(b, length - 1, width),
            probs.reshape(b, length - 1, width), mask.reshape(b, length - 1)))
      stats.new_queries.append(new_total)
      stats.distilled_positions.append(distilled)
      stats.hard_positions.append(hard_total)
      log(f"student KD epoch {epoch}: loss "
          f"{float(np.mean(jax.device_get(losses_))):.4f}, new queries "
          f"{new_total}, distilled positions {distilled}"
          + (f", budget left {aggregator.remaining}" if aggregator else ""))
    return stats

  def _queries(self, aggregator, tokens, weights, positions, index):
    """Flat `[B * (L-1)]` masks of new hard positions and of positions with
    a stored answer, and the student's candidate sets at every position."""
    setup = self.setup
    logits, ranks = self._analyse(self.params, tokens)
    real = (weights[:, 1:] > 0).reshape(-1)
    hard = (np.asarray(ranks).reshape(-1) >= setup.hard_threshold) & real
    keys = (np.repeat(np.maximum(index, 0), tokens.shape[1] - 1)
            * aggregator.sums.num_positions + positions)
    answered = (aggregator.store.find(keys) >= 0) & real
    width = aggregator.store.width
    sets = aggregation.candidate_sets(
        logits.reshape(-1, logits.shape[-1]), max_candidates=width,
        top_p=setup.top_p, top_k=setup.top_k)
    return hard & ~answered, answered, sets
