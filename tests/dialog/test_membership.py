"""User-level LiRA (`dpjax.pipelines.dialog.membership`): the statistic against an
explicit float64 loop over (target, user), the metrics against brute force,
the splits' balance, the train-split filter of the MultiDoGo tasks, and the
experiment end to end on a shrunk sample run."""
from __future__ import annotations

import itertools
import json
import math
import os

import gin
import numpy as np
import pytest
from scipy import stats

from jax_privacy import auditing

from dpjax import errors
from dpjax.pipelines.dialog import membership
from dpjax.privacy import ledger as ledger_lib


def test_each_user_trains_exactly_half_of_the_models():
  member = membership.membership_splits(50, 6, np.random.default_rng(0))
  assert member.shape == (6, 50) and (member.sum(0) == 3).all()


def test_each_half_is_equally_likely():
  """Over 6,000 users, each of the C(4, 2) = 6 IN-sets appears at rate 1/6."""
  member = membership.membership_splits(6000, 4, np.random.default_rng(1))
  counts = {}
  for column in member.T:
    counts[tuple(column)] = counts.get(tuple(column), 0) + 1
  assert len(counts) == 6
  # z-scores of binomial(6000, 1/6) counts.
  for c in counts.values():
    assert abs(c - 1000) / math.sqrt(6000 / 6 * 5 / 6) < 4


@pytest.mark.parametrize("m", [3, 2])
def test_too_few_or_odd_model_counts_are_refused(m):
  with pytest.raises(ValueError, match="even and >= 4"):
    membership.membership_splits(10, m, np.random.default_rng(0))


def test_user_scores_are_minus_the_mean_nll_per_token_of_each_user():
  rng = np.random.default_rng(2)
  users = np.array(["b", "a", "c", "a", "b", "a"])
  sums, counts = rng.random(6) * 10, rng.integers(1, 9, 6).astype(float)
  got = membership.user_scores(sums, counts, users, ["a", "b", "c"])
  for i, u in enumerate("abc"):
    rows = users == u
    assert got[i] == pytest.approx(-sums[rows].sum() / counts[rows].sum())


def _lira_loop(scores, member):
  """Λ by the definition, one (target, user) at a time, in float64."""
  num_models, num_users = scores.shape
  scores = np.array([[x - np.mean(row) for x in row] for row in scores])
  out = np.zeros_like(scores, dtype=np.float64)
  for m in range(num_models):
    shadows = [k for k in range(num_models) if k != m]
    variances = {}
    for flag in (True, False):
      residuals, dof = [], 0
      for u in range(num_users):
        group = [scores[k, u] for k in shadows if member[k, u] == flag]
        residuals += [(x - np.mean(group)) ** 2 for x in group]
        dof += len(group) - 1
      variances[flag] = sum(residuals) / dof
    for u in range(num_users):
      mean = lambda flag: np.mean([scores[k, u] for k in shadows
                                   if member[k, u] == flag])
      out[m, u] = (stats.norm.logpdf(scores[m, u], mean(True),
                                     math.sqrt(variances[True]))
                   - stats.norm.logpdf(scores[m, u], mean(False),
                                       math.sqrt(variances[False])))
  return out


def test_lira_scores_match_the_explicit_loop():
  rng = np.random.default_rng(3)
  member = membership.membership_splits(7, 6, rng)
  scores = rng.normal(size=(6, 7)) + 0.5 * member
  np.testing.assert_allclose(membership.lira_scores(scores, member),
                             _lira_loop(scores, member), rtol=1e-10)


def test_a_shift_of_a_whole_model_does_not_move_its_statistic():
  rng = np.random.default_rng(6)
  member = membership.membership_splits(9, 6, rng)
  scores = rng.normal(size=(6, 9))
  shifted = scores + rng.normal(size=(6, 1)) * 10
  np.testing.assert_allclose(membership.lira_scores(shifted, member),
                             membership.lira_scores(scores, member),
                             rtol=1e-9, atol=1e-9)


def test_the_attack_separates_members_only_when_the_scores_do():
  rng = np.random.default_rng(4)
  member = membership.membership_splits(400, 8, rng)
  per_user = rng.normal(size=(1, 400))  # users differ; the attack adjusts
  leaky = per_user + rng.normal(size=(8, 400)) * 0.3 + 0.6 * member
  blind = per_user + rng.normal(size=(8, 400)) * 0.3
  strong = membership.attack_metrics(membership.lira_scores(leaky, member),
                                     member)
  none = membership.attack_metrics(membership.lira_scores(blind, member),
                                   member)
  assert strong["auc"] > 0.85 and strong["tpr@0.01"] > 0.1
  assert abs(none["auc"] - 0.5) < 0.04 and none["tpr@0.1"] < 0.16


def _auditor_bounds(lira, member, delta, confidence):
  """jax-privacy's estimators called directly on the IN and OUT pairs."""
  auditor = auditing.CanaryScoreAuditor(lira[member], lira[~member])
  return (auditor.epsilon_one_run_fdp(1 - confidence, delta),
          auditor.epsilon_one_run(1 - confidence, delta))


def test_epsilon_bounds_are_jax_privacys_estimators_on_the_pairs():
  rng = np.random.default_rng(7)
  member = membership.membership_splits(300, 6, rng)
  scores = rng.normal(size=(1, 300)) + rng.normal(size=(6, 300)) * 0.3 \
      + 0.5 * member
  lira = membership.lira_scores(scores, member)
  got = membership.epsilon_bounds(lira, member, delta=1e-3)
  fdp, one_run = _auditor_bounds(lira, member, 1e-3, 0.95)
  assert got["epsilon_lower_bound"] > 0  # a leak the comparison can see
  assert got["epsilon_lower_bound"] == pytest.approx(fdp, rel=1e-9)
  assert got["epsilon_one_run"] == pytest.approx(one_run, rel=1e-9)
  assert (got["bound_delta"], got["confidence"]) == (1e-3, 0.95)


def test_bound_delta_is_resolved_for_the_smallest_half():
  member = np.zeros((4, 10), bool)
  for m, n in enumerate((5, 4, 6, 5)):
    member[m, :n] = True
  assert membership.bound_delta(None, member) == 1 / (2 * 4)  # 1/(2n)
  assert membership.bound_delta("1/n", member) == 1 / 4
  assert membership.bound_delta(1e-6, member) == 1e-6


def test_metrics_match_brute_force():
  rng = np.random.default_rng(5)
  member = rng.random((4, 30)) < 0.5
  scores = np.round(rng.normal(size=(4, 30)) + member, 1)  # with ties
  got = membership.attack_metrics(scores, member)
  pos, neg = scores[member], scores[~member]
  wins = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg))
  assert got["auc"] == pytest.approx(wins / (len(pos) * len(neg)))
  for f in membership.FPRS:
    best = max((np.mean(pos >= t) for t in np.unique(scores)
                if np.mean(neg >= t) <= f), default=0.0)
    assert got[f"tpr@{f:g}"] == pytest.approx(best)


def test_train_split_keeps_the_named_conversations_and_refuses_others(tmp_path):
  import tasks
  from dpjax.data import arrays
  from dpjax.data.readers import multidogo
  from tasks import multidogo as multidogo_tasks
  tasks.register_tasks()
  train = multidogo.load_split("train", multidogo.DEFAULT_DATA_DIR,
                               multidogo.PAPER_DOMAINS)
  keep = sorted(c.conversation_id for c in train)[::3]
  multidogo_tasks.register_multidogo_task(
      "multidogo_lm_kept_test", pack=False, chunk_length=63,
      train_conversations=keep)
  lengths = {"inputs": 1, "targets": 63}
  users = arrays.load_task_column("multidogo_lm_kept_test", "train", lengths,
                                  "user_id")
  assert sorted({u.decode() for u in users}) == keep
  validation = arrays.load_task_column("multidogo_lm_kept_test", "validation",
                                       lengths, "user_id")
  assert len(set(validation)) > 0  # other splits are whole
  multidogo_tasks.register_multidogo_task(
      "multidogo_lm_kept_test", pack=False, train_conversations=[*keep, "nope"])
  with pytest.raises(ValueError, match="not in the train split"):
    arrays.load_task_column("multidogo_lm_kept_test", "train", lengths,
                            "user_id")
  with pytest.raises(FileNotFoundError, match="conversation id file"):
    multidogo_tasks.read_conversation_ids(str(tmp_path / "missing.txt"))


# One step on one domain (180 users, so each model scores fewer chunks), 16
# users expected a step (~55 rows: mostly one call of 64); the model is the
# sample's, from its pretrained start (gin/dialog_sample.gin).
SHRUNK = ["EPOCHS = None", "TRAIN_STEPS = 1",
          "register_multidogo_tasks.domains = ['AIRLINE']",
          "BATCH_SIZE = 16", "MICROBATCH_SIZE = 64", "train.log_period = 1"]
# A small ε, not the paper's 8: calibrating σ (once per model, whose
# dataset sizes differ) is cheaper the more noise it finds.
EPS = 1.0
RUN = dict(settings=("user",), num_models=4, bindings=SHRUNK, batch_size=32,
           epsilon=EPS)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("membership"))
  yield out, membership.run(out, **RUN)
  gin.clear_config()  # the runs' bindings must not leak


def test_every_model_trains_on_its_half_of_the_users(experiment):
  out, result = experiment
  row, = result["rows"]
  for m in range(4):
    kept = open(os.path.join(out, "splits", f"model{m}.txt")).read().split()
    ledger = ledger_lib.PrivacyLedger.load(os.path.join(
        out, "runs", "user", f"model{m}", ledger_lib.LEDGER_FILENAME))
    assert ledger.dataset_size == len(kept)  # users, the unit of privacy
    assert ledger.sampling["method"] == "user_poisson"
  # Each user is in exactly two of the four splits.
  listed = [u for m in range(4) for u in open(os.path.join(
      out, "splits", f"model{m}.txt")).read().split()]
  assert len(listed) == 2 * row["users"]
  assert set(np.unique(listed, return_counts=True)[1]) == {2}


def test_row_and_table(experiment):
  out, result = experiment
  row, = result["rows"]
  assert row["setting"] == "user" and row["pairs"] == 4 * row["users"]
  assert 0 <= row["auc"] <= 1 and row["epsilon_spent"] <= EPS * (1 + 1e-9)
  assert math.isfinite(row["validation_ppl"]) and row["validation_ppl"] > 1
  assert "| user-level DP |" in open(result["table_md"]).read()


def test_epsilon_bounds_from_the_runs_scores_and_ledgers(experiment):
  """The row's bounds recomputed from the cached scores, the written
  splits and the largest δ of the runs' ledgers, by jax-privacy directly."""
  out, result = experiment
  row, = result["rows"]
  splits = [set(open(os.path.join(out, "splits", f"model{m}.txt")).read()
                .split()) for m in range(4)]
  users = sorted(set().union(*splits))
  member = np.array([[u in s for u in users] for s in splits])
  delta = max(ledger_lib.PrivacyLedger.load(os.path.join(
      out, "runs", "user", f"model{m}", ledger_lib.LEDGER_FILENAME)).delta
              for m in range(4))
  with open(os.path.join(out, "scores", "user.json")) as f:
    lira = membership.lira_scores(np.array(json.load(f)["scores"]), member)
  fdp, one_run = _auditor_bounds(lira, member, delta, 0.95)
  assert row["bound_delta"] == pytest.approx(delta, rel=1e-12)
  assert row["confidence"] == 0.95
  assert row["epsilon_lower_bound"] == pytest.approx(fdp, rel=1e-9, abs=1e-12)
  assert row["epsilon_one_run"] == pytest.approx(one_run, rel=1e-9,
                                                 abs=1e-12)
  assert "ε lower bound (one run)" in open(result["table_md"]).read()


def test_rerun_retrains_nothing(experiment, monkeypatch):
  from dpjax.training import trainer
  out, result = experiment
  monkeypatch.setattr(trainer, "train", lambda: pytest.fail("retrained"))
  again = membership.run(out, **RUN)
  assert again["rows"] == result["rows"]


def test_rerun_with_other_settings_is_refused(experiment):
  from dpjax.training import checkpoints
  out, _ = experiment
  with pytest.raises(checkpoints.CheckpointMismatchError, match="num_models"):
    membership.run(out, **dict(RUN, num_models=6))


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
  for kwargs, match in ((dict(num_models=5), "even and >= 4"),
                        (dict(settings=("group",)), "settings are")):
    with pytest.raises(ValueError, match=match):
      membership.run(str(tmp_path / "out"), **kwargs)
  assert not os.path.exists(tmp_path / "out")


def test_settings_set_their_unit_and_noise():
  assert membership.setting_fields("user", 8.0, 200) == {"target_epsilon": 8.0}
  example = membership.setting_fields("example", 3.0, 200)
  assert example["privacy_unit"] == "example" and example["batch_size"] == 200
  nonprivate = membership.setting_fields("nonprivate", 3.0, 200)
  assert nonprivate["target_epsilon"] == "inf"
  assert nonprivate["redaction_probability"] == 1.0
  with pytest.raises(ValueError, match="unknown setting"):
    membership.setting_fields("group", 3.0, 200)


def test_cli_refuses_unknown_settings(tmp_path):
  from dpjax.pipelines.dialog import __main__ as dialog_cli
  with pytest.raises(errors.UsageError, match="--settings takes"):
    dialog_cli.main(["membership", f"--output_dir={tmp_path}",
                     "--settings=user,group"])
