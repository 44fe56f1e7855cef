"""Canary insertion, exposure, extraction and the ε lower bound, each
against hand counts or closed forms."""
from __future__ import annotations

import collections
import math
import os

import jax
import numpy as np
import pytest
from jax_privacy import auditing

from dpjax.data.readers import msmarco
from dpjax.pipelines.retrieval import canaries
from dpjax.models import t5

SAMPLE = msmarco.DEFAULT_SAMPLE_DIR


@pytest.fixture(scope="module")
def inserted(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("canaries"))
  return out, canaries.insert_canaries(SAMPLE, out, per_cell=2, seed=3)


def _lines(path):
  with open(path, encoding="utf-8") as f:
    return f.read().splitlines()


def test_insertion_counts_per_kind_and_repetition(inserted):
  out, made = inserted
  cells = collections.Counter((c.kind, c.repetitions) for c in made)
  assert cells == {(k, r): 2 for k in canaries.KINDS for r in (1, 10, 100)}
  rows = 2 * 3 * (1 + 10 + 100)
  for name, extra in (("qrels.train.tsv", rows), ("queries.train.tsv", rows),
                      ("collection.tsv", 2 * 3)):  # 2 x 3 digits passages
    assert len(_lines(os.path.join(out, name))) == \
        len(_lines(os.path.join(SAMPLE, name))) + extra
  for name in ("qrels.dev.tsv", "queries.dev.tsv"):
    assert _lines(os.path.join(out, name)) == _lines(os.path.join(SAMPLE, name))
  # Read back with the task's readers: each canary is r training pairs.
  pairs = msmarco.load_query_passage_pairs(out, "train")
  assert pairs[:2998] == msmarco.load_query_passage_pairs(SAMPLE, "train")
  found = collections.Counter((q, pid, p) for _, pid, q, p in pairs)
  for c in made:
    assert found[(c.query, c.pid, c.document)] == c.repetitions
    assert len(c.secret) == 10 and c.secret.isdigit()
    assert c.query.endswith(" " + c.secret)


def test_canary_documents_follow_their_kind(inserted):
  _, made = inserted
  original = msmarco.load_query_passage_pairs(SAMPLE, "train")
  queries_of = collections.defaultdict(set)
  passages = {pid: p for _, pid, _, p in original}
  for _, pid, q, _ in original:
    queries_of[pid].add(q)
  assert len({c.pid for c in made}) == len(made)  # no shared passage
  for c in made:
    assert any(c.prefix == q for _, _, q, _ in original)
    if c.kind == "digits_document":
      assert c.pid not in passages and len(c.document) == 10 and c.document.isdigit()
    elif c.kind == "own_document":
      assert c.prefix in queries_of[c.pid] and c.document == passages[c.pid]
    else:
      assert c.prefix not in queries_of[c.pid] and c.document == passages[c.pid]


def test_insertion_is_deterministic_and_resumable(inserted, tmp_path):
  out, made = inserted
  again = canaries.insert_canaries(SAMPLE, str(tmp_path / "a"), per_cell=2, seed=3)
  assert again == made
  for name in ("collection.tsv", "queries.train.tsv", "qrels.train.tsv"):
    assert _lines(tmp_path / "a" / name) == _lines(os.path.join(out, name))
  assert canaries.load_canaries(out) == made
  other = canaries.make_canaries(msmarco.load_query_passage_pairs(SAMPLE, "train"),
                                 first_pid=10**6, first_qid=10**7, seed=4)
  assert [c.secret for c in other] != [c.secret for c in made]


def test_exposure_from_known_scores():
  # Log-likelihoods: the secret -5; two of four candidates beat it.
  got = canaries.exposure(-5.0, np.array([-1.0, -3.0, -6.0, -7.0]), space_size=101)
  assert got["better"] == 2 and got["sample_rank"] == 3
  assert got["rank"] == 1 + 100 * 2 / 4
  assert got["exposure"] == pytest.approx(math.log2(101) - math.log2(51))
  top = canaries.exposure(0.0, np.array([-1.0, -2.0]))
  assert top["better"] == 0 and top["exposure"] == pytest.approx(math.log2(1e10))


def test_skewnorm_exposure_matches_a_normal_tail():
  # Candidates' log-likelihoods ~ N(0, 1); the secret 3 sigma above: about
  # -log2 Phi(-3) = 9.53 bits.
  scores = np.random.default_rng(0).normal(size=20000)
  got = canaries.exposure(3.0, scores)["exposure_skewnorm"]
  assert got == pytest.approx(-math.log2(0.0013499), abs=0.4)


def test_extraction_is_a_verbatim_match():
  assert canaries.extracted("0123456789", ["what is 0123456789 ?"])
  assert canaries.extracted("0123456789", ["no", "x0123456789y"])
  assert not canaries.extracted("0123456789", ["0123 456789", "012345678"])
  assert not canaries.extracted("0123456789", [])


def test_clopper_pearson_closed_forms():
  assert canaries.clopper_pearson_lower(10, 10) == pytest.approx(0.05 ** 0.1)
  assert canaries.clopper_pearson_lower(0, 10) == 0.0


def test_epsilon_lower_bound_against_hand_computation():
  f = 1 / 1001
  p = 0.05 ** 0.1  # all 10 of 10 attacks succeed
  # δ = 0: e^{gε} f = p.
  assert canaries.epsilon_lower_bound(10, 10, null_success=f, delta=0.0) == \
      pytest.approx(math.log(p / f), rel=1e-9)
  assert canaries.epsilon_lower_bound(10, 10, null_success=f, delta=0.0,
                                      group_size=2) == \
      pytest.approx(math.log(p / f) / 2, rel=1e-9)
  # g = 2, δ > 0: f x^2 + 2 δ x = p with x = e^ε.
  d = 1e-3
  x = (-2 * d + math.sqrt(4 * d * d + 4 * f * p)) / (2 * f)
  assert canaries.epsilon_lower_bound(10, 10, null_success=f, delta=d,
                                      group_size=2) == pytest.approx(math.log(x), rel=1e-9)
  # No evidence beyond chance: 0.
  assert canaries.epsilon_lower_bound(1, 10, null_success=0.5, delta=0.0) == 0.0


def test_sequence_scorer_matches_the_training_loss():
  config = t5.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_heads=2,
                       num_encoder_layers=1, num_decoder_layers=1,
                       dropout_rate=0.0)
  params, _ = t5.init_params(config, jax.random.PRNGKey(0), input_length=6,
                             target_length=5)
  rng = np.random.default_rng(0)
  inputs = np.array([5, 9, 3, 7, 1, 0], np.int32)
  targets = rng.integers(2, 50, size=(3, 5)).astype(np.int32)
  targets[0, 3:] = [1, 0]
  targets[1, 4] = 1
  targets[2, 2:] = [1, 0, 0]
  got = np.asarray(canaries.make_sequence_scorer(config)(params, inputs, targets))
  weights = (targets != 0).astype(np.float32)
  batch = {"encoder_input_tokens": np.repeat(inputs[None], 3, 0),
           "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
           "decoder_target_tokens": targets, "decoder_loss_weights": weights}
  mean_nll = np.asarray(t5.make_batch_loss(config)(params, batch))
  np.testing.assert_allclose(-got, mean_nll * weights.sum(1), rtol=1e-5)


def _auditor_bounds(inside, outside, delta, confidence=0.95):
  """jax-privacy's estimators called directly on IN and OUT scores."""
  auditor = auditing.CanaryScoreAuditor(inside, outside)
  return (auditor.epsilon_one_run_fdp(1 - confidence, delta),
          auditor.epsilon_one_run(1 - confidence, delta))


def test_one_run_bounds_are_jax_privacys_estimators():
  # Trained-on secrets score about 3 above a candidate: a leak to detect.
  rng = np.random.default_rng(0)
  inside, outside = rng.normal(3.0, 1.0, 60), rng.normal(0.0, 1.0, 60)
  rows = [dict(score=i, candidate_score=o) for i, o in zip(inside, outside)]
  for confidence in (0.95, 0.9):
    got = canaries.one_run_bounds(rows, delta=1e-5, confidence=confidence)
    fdp, one_run = _auditor_bounds(inside, outside, 1e-5, confidence)
    assert got["epsilon_lower_bound_one_run"] > 0
    assert got["epsilon_lower_bound_one_run"] == pytest.approx(fdp, rel=1e-9)
    assert got["epsilon_one_run"] == pytest.approx(one_run, rel=1e-9)


def test_summary_rates_and_bound():
  rows = [dict(repetitions=10, kind=k, sample_rank=r, better=r - 1,
               exposure=e, exposure_skewnorm=e, extracted=x,
               extracted_greedy=x, score=s, candidate_score=c)
          for k, r, e, x, s, c in (("own_document", 1, 9.0, True, -4.0, -9.0),
                                   ("other_document", 3, 5.0, False, -6.0,
                                    -5.0))]
  got = canaries.summarize(rows, delta=1e-4, num_candidates=9)
  pooled = got[0]
  assert pooled["kind"] == "all" and pooled["canaries"] == 2
  assert pooled["sample_rank"] == 2.0 and pooled["extraction"] == 0.5
  assert pooled["epsilon_lower_bound"] == pytest.approx(canaries.epsilon_lower_bound(
      1, 2, null_success=1 / 10, delta=1e-4, group_size=20))
  fdp, one_run = _auditor_bounds([-4.0, -6.0], [-9.0, -5.0], 1e-4)
  assert pooled["epsilon_lower_bound_one_run"] == pytest.approx(fdp, abs=1e-12)
  assert pooled["epsilon_one_run"] == pytest.approx(one_run, abs=1e-12)
  assert pooled["confidence"] == 0.95
  assert [r["kind"] for r in got] == ["all", "own_document", "other_document"]
  assert all("epsilon_lower_bound_one_run" not in r for r in got[1:])


def test_one_run_bounds_pool_each_repetition_count_apart():
  rng = np.random.default_rng(1)
  rows = [dict(repetitions=rep, kind="own_document", sample_rank=1, better=0,
               exposure=1.0, exposure_skewnorm=1.0, extracted=False,
               extracted_greedy=False, score=rng.normal(shift),
               candidate_score=rng.normal())
          for rep, shift in ((1, 0.0), (100, 4.0)) for _ in range(40)]
  got = {r["repetitions"]: r for r in canaries.summarize(
      rows, delta=1e-5, num_candidates=9) if r["kind"] == "all"}
  for rep, row in got.items():
    mine = [r for r in rows if r["repetitions"] == rep]
    fdp, _ = _auditor_bounds([r["score"] for r in mine],
                             [r["candidate_score"] for r in mine], 1e-5)
    assert row["epsilon_lower_bound_one_run"] == pytest.approx(fdp, abs=1e-12)
  assert got[100]["epsilon_lower_bound_one_run"] > 0
