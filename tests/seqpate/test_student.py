"""The SeqPATE student: hard-token ranks against an explicit loop, the KD
loss against numpy, and whole student runs against a hand-made teacher
cache (budget, reuse of stored answers, the noise-free aggregate)."""
import math

import jax
import numpy as np
import pytest

from dpjax.models import gpt2
from dpjax.privacy.secret import RunSecret
from dpjax.pipelines.seqpate import accounting, aggregation, cache, student

CONFIG = gpt2.GPT2Config(vocab_size=24, n_positions=8, d_model=16,
                         num_layers=1, num_heads=2, dropout_rate=0.0)
ROWS, LENGTH, TEACHERS, TOP_K, WIDTH = 6, 6, 3, 5, 8


def numpy_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_pseudo_label_ranks_and_hard_tokens_match_a_loop():
  rng = np.random.default_rng(0)
  logits = rng.integers(0, 4, (3, 7, 10)).astype(np.float32)  # many ties
  targets = rng.integers(0, 10, (3, 7))
  ranks = np.asarray(student.pseudo_label_ranks(logits, targets))
  for i in range(3):
    for j in range(7):
      order = sorted(range(10), key=lambda v: -logits[i, j, v])
      # Rank = position of the first token tied with the target.
      first = next(k for k, v in enumerate(order)
                   if logits[i, j, v] == logits[i, j, targets[i, j]])
      assert ranks[i, j] == first
      # Hard at threshold t: the target is tied with none of the t most
      # likely tokens.
      for t in (1, 2, 5):
        top = [logits[i, j, v] for v in order[:t]]
        assert (ranks[i, j] >= t) == (logits[i, j, targets[i, j]] < min(top))


@pytest.mark.parametrize("distill", ["kl", "top1"])
def test_teacher_terms_match_numpy(distill):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 3, 12)).astype(np.float32)
  cands = np.stack([rng.permutation(12)[:5] for _ in range(6)]).reshape(
      2, 3, 5)
  cands[0, 1, 3:] = -1
  cands[1, 2, 1:] = -1
  probs = rng.uniform(size=(2, 3, 5)).astype(np.float32)
  probs[0, 0, 2] = 0.0  # a zero teacher probability adds nothing to the KL
  probs = np.where(cands >= 0, probs, 0)
  probs /= probs.sum(-1, keepdims=True)
  got = np.asarray(student.teacher_terms(logits, cands, probs, distill))
  for i in range(2):
    for j in range(3):
      keep = cands[i, j][cands[i, j] >= 0]
      q = numpy_softmax(logits[i, j, keep].astype(np.float64))
      p = probs[i, j, :len(keep)].astype(np.float64)
      if distill == "kl":
        want = sum(pv * (math.log(pv) - math.log(qv))
                   for pv, qv in zip(p, q) if pv > 0)
      else:
        want = -math.log(q[int(np.argmax(p))])
      np.testing.assert_allclose(got[i, j], want, rtol=1e-5, atol=1e-6)


def test_step_loss_is_pseudo_nll_plus_lambda_kl(params):
  rng = np.random.default_rng(2)
  # The shapes of `run`'s steps (batch 4, WIDTH candidates): one compile.
  tokens = rng.integers(0, CONFIG.vocab_size, (4, LENGTH)).astype(np.int32)
  weights = np.ones((4, LENGTH), np.float32)
  weights[:, 0] = 0
  weights[1, 4:] = 0
  cands = np.stack([rng.permutation(CONFIG.vocab_size)[:WIDTH]
                    for _ in range(4 * (LENGTH - 1))]).reshape(4, LENGTH - 1,
                                                               WIDTH)
  probs = numpy_softmax(rng.normal(size=cands.shape)).astype(np.float32)
  mask = (rng.uniform(size=(4, LENGTH - 1)) < 0.5).astype(np.float32)
  logits = np.asarray(gpt2.GPT2(CONFIG).apply({"params": params}, tokens),
                      np.float64)
  pseudo = kd = 0.0
  for i in range(4):
    for j in range(LENGTH - 1):
      logp = np.log(numpy_softmax(logits[i, j]))
      pseudo -= weights[i, j + 1] * logp[tokens[i, j + 1]]
      if mask[i, j]:
        q = numpy_softmax(logits[i, j, cands[i, j]])
        kd += (probs[i, j] * np.log(probs[i, j] / q)).sum()
  want = (pseudo + 20.0 * kd) / weights[:, 1:].sum()
  step = student.make_step(CONFIG, 1e-3, lam=20.0, distill="kl")
  owned = jax.tree.map(np.array, params)
  _, _, loss = step(owned, student.optax.adam(1e-3).init(owned), tokens,
                    weights, cands, probs, mask, jax.random.key(0))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


@pytest.fixture(scope="module")
def params():
  return gpt2.init_params(CONFIG, jax.random.key(0), max_length=LENGTH)[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """Pseudo-data and a teacher cache of random top-k distributions."""
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, CONFIG.vocab_size, (ROWS, LENGTH)).astype(np.int32)
  weights = np.ones((ROWS, LENGTH), np.float32)
  weights[:, 0] = 0
  weights[0, 3:] = 0
  directory = str(tmp_path_factory.mktemp("cache"))
  ids = np.stack([[[rng.permutation(CONFIG.vocab_size)[:TOP_K]
                    for _ in range(LENGTH)] for _ in range(ROWS)]
                  for _ in range(TEACHERS)])
  probs = rng.dirichlet(np.ones(TOP_K + 1), ids.shape[:3])[..., :TOP_K]
  fp = cache.fingerprint(tokens)
  cache.write_group(directory, 0, np.arange(TEACHERS), ids, probs,
                    pseudo_fingerprint=fp, vocab_size=CONFIG.vocab_size)
  sums = cache.TeacherSums.from_cache(directory, TEACHERS)
  dense = np.zeros((ROWS, LENGTH, CONFIG.vocab_size))
  for t in range(TEACHERS):  # the teacher sum, by hand
    for s in range(ROWS):
      for j in range(LENGTH):
        dense[s, j, ids[t, s, j]] += probs[t, s, j].astype(np.float32)
  return {"tokens": tokens, "loss_weights": weights}, sums, dense


class Recording(aggregation.Aggregator):
  """An aggregator that remembers every answer it returned."""

  def answer(self, sentences, positions, candidates):
    out = super().answer(sentences, positions, candidates)
    self.log = getattr(self, "log", [])
    self.log.append((np.asarray(sentences), np.asarray(positions), out))
    return out


def run(params, world, *, max_queries, epsilon, sigma=None, epochs=1,
        threshold=0):
  pseudo, sums, _ = world
  ledger = accounting.make_ledger(epsilon, max_queries,
                                  num_teachers=TEACHERS, dataset_size=30,
                                  scale=sigma)
  agg = Recording(sums, ledger, secret=RunSecret.pinned(7),
                  max_candidates=WIDTH)
  setup = student.StudentSetup(batch_size=4, warmup_epochs=1,
                               kd_epochs=epochs, learning_rate=1e-2,
                               hard_threshold=threshold, top_p=0.9)
  s = student.Student(CONFIG, params, pseudo, setup)
  s.warmup(log=lambda _: None)
  stats = s.distill(agg, log=lambda _: None)
  return agg, stats


def test_budget_is_never_exceeded_and_querying_stops_there(params, world):
  real_positions = int((world[0]["loss_weights"][:, 1:] > 0).sum())
  agg, stats = run(params, world, max_queries=7, epsilon=3.0, epochs=2)
  assert real_positions > 7
  queries = sum(e.count for e in agg.ledger.events)
  assert queries == 7 and agg.remaining == 0 and sum(stats.new_queries) == 7
  fresh = [out.fresh.sum() for _, _, out in agg.log]
  assert sum(fresh) == 7
  # After the budget ran out, calls only re-read stored answers.
  spent = np.cumsum(fresh)
  assert all(f == 0 for f, before in zip(fresh, spent - fresh) if before >= 7)
  assert agg.ledger.epsilon_spent() <= 3.0 * 1.01


def test_noise_free_answers_are_reused_and_equal_the_renormalised_sum(
    params, world):
  pseudo, _, dense = world
  real = pseudo["loss_weights"][:, 1:] > 0
  agg, stats = run(params, world, max_queries=1000, epsilon=math.inf,
                   sigma=0.0, epochs=2)
  # Threshold 0: every real position is hard, all answered in epoch 0.
  assert stats.new_queries == [int(real.sum()), 0]
  assert stats.distilled_positions == [int(real.sum())] * 2
  assert math.isinf(agg.ledger.epsilon_spent())
  first = {}
  for sentences, positions, out in agg.log:
    for s, j, c, p, f in zip(sentences, positions, out.candidates, out.probs,
                             out.fresh):
      if (s, j) in first:
        assert not f
        np.testing.assert_array_equal(c, first[s, j][0])
        np.testing.assert_array_equal(p, first[s, j][1])  # bit-for-bit
        continue
      assert f
      first[s, j] = (c, p)
      keep = c[c >= 0]
      want = dense[s, j, keep] / dense[s, j, keep].sum()
      np.testing.assert_allclose(p[:len(keep)], want, rtol=1e-6)
      assert (p[len(keep):] == 0).all()
  assert len(first) == real.sum()
