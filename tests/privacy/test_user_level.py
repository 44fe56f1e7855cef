"""User-level DP-SGD: Poisson sampling of users, at most k examples each,
averaged after clipping. The sampler against its definition, one user's
bound on the clipped sum (vmap and ghost) against a float64 loop, ε against
dp-accounting called directly at the user count, and a run from gin."""
from __future__ import annotations

import json
import math
import os

import dp_accounting
from dp_accounting import pld
import gin
import jax
import numpy as np
import pytest

from dpjax import configurables
from dpjax import errors, export, gin_cli
from dpjax.training import plan as plan_lib, run_config
from dpjax.privacy import clipping, ghost, ledger as ledger_lib, sampling
from tests.audit import audits
from tests.privacy import test_ghost

# 40 users owning 1 to 7 examples each (155 examples), interleaved.
COUNTS = np.arange(40) % 7 + 1
USERS = np.random.default_rng(0).permutation(np.repeat(np.arange(40), COUNTS))


def user_sampler(k=3, seed=5, expected=8):
  return sampling.UserPoissonSampler(USERS.astype(str), expected, seed=seed,
                                     max_examples_per_user=k)


def test_at_most_k_examples_per_user_weighted_to_sum_to_one():
  s = user_sampler()
  for step in range(20):
    idx, weights = s.sample(step)
    assert np.all(np.diff(idx) > 0) and idx.dtype == np.int64
    for user in np.unique(USERS[idx]):
      mine = USERS[idx] == user
      assert mine.sum() == min(COUNTS[user], 3)
      np.testing.assert_allclose(weights[mine], 1 / mine.sum())


def test_users_are_poisson_sampled_at_rate_q():
  """Each user in each step independently with probability q = 8/40: the
  inclusion counts over 2,000 steps, per user and per step, against the
  binomial law."""
  s, steps = user_sampler(), 2000
  included = np.zeros((steps, 40), bool)
  for step in range(steps):
    included[step, np.unique(USERS[s.indices(step)])] = True
  q = 8 / 40
  per_user = included.sum(0)
  z = (per_user - steps * q) / math.sqrt(steps * q * (1 - q))
  assert np.abs(z).max() < 4.5
  per_step = included.sum(1)
  assert per_step.mean() == pytest.approx(8, abs=0.25)
  assert per_step.var() == pytest.approx(40 * q * (1 - q), rel=0.15)
  # Two users' inclusions are independent: no correlation beyond noise.
  corr = np.corrcoef(included[:, 6], included[:, 13])[0, 1]
  assert abs(corr) < 4.5 / math.sqrt(steps)


def test_a_users_examples_are_a_uniform_subset():
  """User 6 owns 7 examples; with k = 3 each of them is taken in 3/7 of the
  steps that sample the user."""
  s, user = user_sampler(), 6
  mine = np.flatnonzero(USERS == user)
  taken, sampled = np.zeros(len(mine)), 0
  for step in range(3000):
    idx = s.indices(step)
    chosen = np.isin(mine, idx)
    sampled += chosen.any()
    taken += chosen
  p = 3 / 7
  z = (taken - sampled * p) / math.sqrt(sampled * p * (1 - p))
  assert sampled > 400 and np.abs(z).max() < 4.5


def test_deterministic_per_step_and_seed():
  a, b = user_sampler(), user_sampler()
  for step in (9, 0, 3):  # any order: a resumed run draws the same
    np.testing.assert_array_equal(a.sample(step)[0], b.sample(step)[0])
  assert not np.array_equal(a.indices(1), user_sampler(seed=6).indices(1))


def test_microbatches_carry_the_weights_and_drop_nothing():
  s = user_sampler()
  for step in range(10):
    idx, weights = s.sample(step)
    packed, mask = s.microbatches(step, 4)
    assert packed.shape == mask.shape and packed.shape[1] == 4
    assert packed.shape[0] >= math.ceil(s.max_batch_size / 4)
    np.testing.assert_array_equal(packed.reshape(-1)[:idx.size], idx)
    np.testing.assert_array_equal(mask.reshape(-1)[:idx.size], weights)
    assert not mask.reshape(-1)[idx.size:].any()


def test_scheme_and_description_name_the_user():
  s = user_sampler()
  assert s.dataset_size == 40 and s.num_examples == len(USERS) == 155
  assert s.scheme == sampling.PoissonScheme(8 / 40, unit="user")
  description = json.loads(json.dumps(s.describe()))
  assert description["unit"] == "user"
  assert sampling.scheme_from_description(description) == s.scheme


def test_bad_arguments():
  with pytest.raises(ValueError, match="max_examples_per_user"):
    user_sampler(k=0)
  with pytest.raises(ValueError, match="expected_users"):
    user_sampler(expected=41)


# --- The clipped sum: one user moves it by at most C. ---------------------

N = test_ghost.N
OWNER = np.array([0, 0, 1, 0, 2, 2])  # row 2 is the padding row


@pytest.fixture(scope="module")
def gpt2():
  loss, params, batch = test_ghost.gpt2_problem()
  batch = test_ghost.with_dropout(batch)
  grads, norms, finite = test_ghost.loop_reference(loss, params, batch)
  return loss, params, batch, grads, norms, finite


def user_weights(mask):
  """1 / (the user's real rows) on real rows: what the sampler packs."""
  counts = np.maximum(np.bincount(OWNER, weights=mask > 0), 1)
  return np.where(mask > 0, 1 / counts[OWNER], 0).astype(np.float32)


CLIPPED_SUMS = {
    "vmap": lambda loss, c: clipping.clipped_grad(loss, clip_norm=c),
    "ghost": lambda loss, c: ghost.ghost_clipped_grad(loss, clip_norm=c),
    "ghost_second_pass": lambda loss, c: ghost.ghost_clipped_grad(
        loss, clip_norm=c, summation="second_pass"),
}


@pytest.mark.parametrize("method", sorted(CLIPPED_SUMS))
def test_weighted_sum_matches_a_float64_loop(gpt2, method):
  loss, params, batch, grads, norms, finite = gpt2
  clip = float(np.median(norms[finite]))
  weights = user_weights(test_ghost.MASK)
  got, _ = test_ghost.jit(CLIPPED_SUMS[method](loss, clip))(params, batch,
                                                            weights)
  want = [sum(grads[i][j] * weights[i] * min(1.0, clip / norms[i])
              for i in range(N) if weights[i] > 0 and finite[i])
          for j in range(len(grads[0]))]
  for g, w in zip(test_ghost.leaves64(got), want):
    test_ghost.assert_close(g, w)


@pytest.mark.parametrize("method", sorted(CLIPPED_SUMS))
def test_removing_one_user_moves_the_sum_by_at_most_c(gpt2, method):
  """User 0 owns three real rows, all clipped at a small C: removed, the sum
  moves by at most C, where three 0/1-masked examples move it by more."""
  loss, params, batch, _, norms, _ = gpt2
  clip = 0.1 * float(norms[norms > 0].min())
  fn = test_ghost.jit(CLIPPED_SUMS[method](loss, clip))
  mask = test_ghost.MASK
  without = np.where(OWNER == 0, 0, mask).astype(np.float32)

  def moved(with_mask, without_mask):
    a, _ = fn(params, batch, with_mask)
    b, _ = fn(params, batch, without_mask)
    return math.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in zip(
        test_ghost.leaves64(a), test_ghost.leaves64(b))))

  assert moved(user_weights(mask), user_weights(without)) <= clip * (1 + 1e-5)
  assert moved(mask, without) > 1.5 * clip  # the example-level weights


def test_weights_above_one_count_as_one():
  """A mask entry > 1 cannot scale an example past C."""
  params = {"w": np.ones(3, np.float32)}
  loss = lambda p, x: jax.numpy.dot(p["w"], x)
  xs = np.eye(3, dtype=np.float32) * 10
  f = clipping.clipped_grad(loss, clip_norm=1.0)
  big, _ = f(params, xs, np.array([5.0, 1.0, 0.0], np.float32))
  one, _ = f(params, xs, np.array([1.0, 1.0, 0.0], np.float32))
  np.testing.assert_allclose(big["w"], one["w"])
  np.testing.assert_allclose(one["w"], [1.0, 1.0, 0.0])


# --- Accounting and refusals of the plan. ---------------------------------

def config(**overrides):
  """A run's settings, none from gin bindings an earlier test left."""
  gin.clear_config()
  fields = dict(model_dir="/tmp/unused", model_config=None,
                mixture_or_task_name="x", task_feature_lengths={},
                batch_size=8, train_steps=50, privacy_unit="user",
                max_examples_per_user=3, target_epsilon=3.0)
  return run_config.RunConfig(**{**fields, **overrides})


def user_plan(**overrides):
  return plan_lib.make_plan(config(**overrides), n=len(USERS),
                            sampling_seed=11, secret_source="os_entropy",
                            unit_ids=USERS)


def test_user_level_epsilon_is_dp_accountings_at_the_user_count():
  plan = user_plan()
  assert plan.privacy.dataset_size == 40 and plan.delta == 1 / 80
  assert plan.privacy.guarantee()["user_level"] == {"user_column": "user_id",
                                     "max_examples_per_user": 3}
  assert plan.normalizer == pytest.approx(8)
  event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      8 / 40, dp_accounting.GaussianDpEvent(plan.noise_multiplier)), 50)
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      event).get_epsilon(1 / 80)
  assert plan.planned_epsilon == pytest.approx(direct, rel=1e-9)
  assert 0.99 * 3 <= direct <= 3
  ledger = plan.ledger
  ledger.record_dp_steps(50, noise_multipliers=plan.noise_multipliers)
  assert ledger.epsilon_spent() == pytest.approx(direct, rel=1e-9)
  # The ledger rebuilds the user-level scheme from its own record.
  again = ledger_lib.PrivacyLedger.from_json(ledger.to_json())
  assert again.epsilon_spent() == pytest.approx(direct, rel=1e-9)
  assert again.sampling["unit"] == "user"


@pytest.mark.parametrize("overrides, message", [
    (dict(sampling_method="shuffle"), "sampling_method must be 'poisson'"),
    (dict(clip_norm="adaptive"), "does not combine"),
    (dict(max_examples_per_user=0), "max_examples_per_user"),
    (dict(privacy_unit="person"), "privacy_unit must be one of"),
    (dict(batch_size=41), "of training users n = 40"),
])
def test_bad_user_level_settings_are_refused(overrides, message):
  with pytest.raises(errors.UsageError, match=message):
    user_plan(**overrides)


# --- A run from gin: MultiDoGo conversations as users. --------------------

TINY = ["TRAIN_STEPS = 3", "BATCH_SIZE = 12", "MICROBATCH_SIZE = 16",
        "TASK_FEATURE_LENGTHS = {'inputs': 1, 'targets': 31}",
        "register_multidogo_tasks.chunk_length = 31",
        "train.checkpoint_period = 3", "train.log_period = 1"]


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("user_level")
  gin.clear_config()
  try:
    gin_cli.configure(["dialog_sample_user_level.gin"],
                      [f"MODEL_DIR = '{model_dir}'", *TINY])
    result = configurables.train()
    config = configurables.run_config()
  finally:
    gin.clear_config()
  return model_dir, result, config


def test_run_accounts_for_conversations(user_run):
  model_dir, result, config = user_run
  with open(os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)) as f:
    ledger = json.load(f)
  sampled = ledger["sampling"]
  users = 540  # the sample's training conversations
  assert sampled["method"] == "user_poisson"
  assert ledger["dataset_size"] == users == sampled["dataset_size"]
  assert sampled["num_examples"] > 2 * users  # several chunks each
  assert ledger["delta"] == pytest.approx(1 / (2 * users))
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          12 / users, dp_accounting.GaussianDpEvent(
              ledger["noise_multiplier"])), 3)).get_epsilon(1 / (2 * users))
  assert result["epsilon_spent"] == pytest.approx(direct, rel=1e-9)
  assert 0.99 * 8 <= direct <= 8
  unit, adjacency = export.unit_and_adjacency(ledger, config.model_config,
                                              None)
  assert unit.startswith("one user") and adjacency == "add_or_remove_one_user"


def test_a_task_without_the_user_column_is_refused(tmp_path):
  gin.clear_config()
  try:
    gin_cli.configure(["dialog_sample_user_level.gin"],
                      [f"MODEL_DIR = '{tmp_path / 'run'}'", *TINY,
                       "register_multidogo_tasks.pack = True"])
    with pytest.raises(errors.UsageError, match="has no feature 'user_id'"):
      configurables.train()
  finally:
    gin.clear_config()
  assert not os.path.exists(tmp_path / "run")


def test_dry_run_counts_users(tmp_path, capsys):
  from dpjax import train
  try:
    train.main(["--gin_file=dialog_sample_user_level.gin",
                f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                *(f"--gin_bindings={b}" for b in TINY), "--dry_run"])
  finally:
    gin.clear_config()
  record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert record["privacy_unit"] == "user" and record["n"] == 540
  assert record["sampling"] == "user_poisson"
  assert record["q"] == pytest.approx(12 / 540)
  assert not os.path.exists(tmp_path / "run")


def test_an_audit_of_this_run_stays_at_or_below_its_epsilon(tmp_path):
  """`audits.AUDITS` audits (`python -m dpjax.audit`, fresh secrets) of
  the user-level run at ε = 3: canary users, Poisson-sampled at the user
  rate (tests/audit)."""
  bindings = [b.replace(" = ", "=", 1) for b in TINY]
  audits.assert_honest(audits.honest_audits(
      tmp_path, "dialog_sample_user_level.gin", *bindings, "TRAIN_STEPS=2"),
      "user-level")
