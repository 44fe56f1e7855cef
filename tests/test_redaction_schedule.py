"""The redaction schedule (Kabra & Elenberg, Findings of EMNLP 2023, arXiv
2305.14208): p(t), the public coin flips, the non-private step on redacted
data, and mixed runs of `dpjax.train`.

The trainer runs use a tiny GPT-2 on the embedded semantic-parse samples:
TreeDST utterances play the original (private) data, SMCalFlow utterances the
redacted (public) data.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.training import checkpoints, plan as plan_lib
from dpjax.training import state as state_lib, step as step_lib
from dpjax import configurables
from dpjax import errors, gin_cli, verify
from dpjax.data import arrays as data_arrays
from dpjax.models import trainable
from dpjax.privacy import accounting, ledger as ledger_lib
from dpjax.privacy import optimizers, sampling
from dpjax.privacy.mechanisms import redaction_schedule as rs
from tests import test_trainer
from dpjax.privacy import secret

# --- The schedules ------------------------------------------------------------


T, ETA = 10, 15.0


def p(name):
  return rs.probabilities(name, T, eta=ETA)


def test_linear_schedule_matches_the_paper_formula():
  np.testing.assert_allclose(p("linear")[[0, 5, 9]], [1.0, 0.5, 0.1])


def test_step_schedule_is_redacted_for_the_first_half():
  np.testing.assert_array_equal(p("step"), [1] * 5 + [0] * 5)
  np.testing.assert_array_equal(rs.probabilities("step", 5), [1, 1, 1, 0, 0])


def test_exp_concave_schedule_matches_the_paper_formula():
  """exp_concave: 1 - exp((eta / T)(t - T))."""
  np.testing.assert_allclose(
      p("exp_concave")[[0, 5, 9]],
      [1 - math.exp(-15.0), 1 - math.exp(-7.5), 1 - math.exp(-1.5)],
      rtol=1e-12)


def test_exp_convex_schedule_matches_the_paper_formula():
  """exp_convex: exp(-eta t / T)."""
  np.testing.assert_allclose(
      p("exp_convex")[[0, 5, 9]],
      [1.0, math.exp(-7.5), math.exp(-13.5)], rtol=1e-12)


def test_constant_schedule_is_p_at_every_step():
  np.testing.assert_array_equal(
      rs.probabilities("constant", 4, p=0.25), [0.25] * 4)


@pytest.mark.parametrize("name", ["linear", "step", "exp_convex",
                                  "exp_concave"])
def test_schedule_never_goes_back_to_redacted_data(name):
  assert np.all(np.diff(p(name)) <= 0), name


def test_hotter_eta_keeps_exp_concave_near_1_longer():
  assert np.all(rs.probabilities("exp_concave", T, eta=30) > p("exp_concave"))


def test_hotter_eta_drops_exp_convex_faster():
  assert np.all(rs.probabilities("exp_convex", T, eta=30)[1:]
                < p("exp_convex")[1:])


@pytest.mark.parametrize("args, kwargs, message", [
    (("cosine", 10), {}, "unknown redaction schedule"),
    (("linear", 0), {}, "total_steps"),
    (("exp_concave", 10), {"eta": 0.0}, "eta > 0"),
    (("constant", 10), {}, "p exactly"),
    (("linear", 10), {"p": 0.5}, "p exactly"),
    (("constant", 10), {"p": 1.5}, r"\[0, 1\]"),
])
def test_bad_schedules_are_refused(args, kwargs, message):
  with pytest.raises(ValueError, match=message):
    rs.probabilities(*args, **kwargs)


LINEAR_20K = rs.probabilities("linear", 20_000)


def test_coin_flips_are_the_same_for_the_same_seed():
  np.testing.assert_array_equal(rs.public_steps(LINEAR_20K, seed=3),
                                rs.public_steps(LINEAR_20K, seed=3))


def test_coin_flips_differ_for_another_seed():
  assert not np.array_equal(rs.public_steps(LINEAR_20K, seed=3),
                            rs.public_steps(LINEAR_20K, seed=4))


def test_coin_flip_count_is_within_5_sd_of_sum_p():
  """Independent Bernoulli(p(t)) coins."""
  coins = rs.public_steps(LINEAR_20K, seed=3)
  sd = math.sqrt(np.sum(LINEAR_20K * (1 - LINEAR_20K)))
  assert abs(coins.sum() - LINEAR_20K.sum()) < 5 * sd


def test_coin_flips_follow_p_early_redacted_late_dp():
  coins = rs.public_steps(LINEAR_20K, seed=3)
  assert coins[:2000].mean() > 0.85 and coins[-2000:].mean() < 0.15


def test_coin_t_depends_on_seed_and_t_only_not_on_total_steps():
  half = np.full(50, 0.5)
  np.testing.assert_array_equal(rs.public_steps(half, 9),
                                rs.public_steps(np.full(80, 0.5), 9)[:50])


def test_coins_of_p_1_and_p_0_are_certain():
  assert rs.public_steps(np.ones(100), 0).all()
  assert not rs.public_steps(np.zeros(100), 0).any()


def test_kind_indices_count_the_earlier_steps_of_the_same_kind():
  public = rs.public_steps(np.full(40, 0.5), seed=1)
  expected, seen = [], {True: 0, False: 0}
  for is_public in public:  # the explicit loop
    expected.append(seen[bool(is_public)])
    seen[bool(is_public)] += 1
  np.testing.assert_array_equal(rs.kind_indices(public), expected)


# --- The privacy plan ---------------------------------------------------------

N, BATCH = 1723, 16  # the TreeDST sample's train split; the batch below


def _plan(dp_steps, **kw):
  sampler = sampling.PoissonSampler(N, BATCH, seed=0)
  args = dict(saved_meta=None, steps=40, batch_size=BATCH,
              sampling_method="poisson", clip_norm=0.1, delta=1e-4,
              target_epsilon=8.0, noise_multiplier=None, accountant="rdp",
              seed=0, redaction={"dp_steps": dp_steps,
                                 "public_steps": 40 - dp_steps})
  return plan_lib.plan_privacy(sampler, **(args | kw))


@pytest.fixture(scope="module")
def ten_dp_steps():
  """The plan of 10 DP and 30 public steps, σ calibrated for ε = 8."""
  return _plan(10)


def test_plan_counts_the_dp_steps_among_all_steps(ten_dp_steps):
  _, plan = ten_dp_steps
  assert plan.dp_steps == 10 and plan.steps == 40


def test_noise_is_calibrated_to_the_target_for_the_dp_steps(ten_dp_steps):
  ledger, _ = ten_dp_steps
  direct = accounting.dpsgd_epsilon(ledger.noise_multiplier, BATCH / N, 10,
                                    1e-4, "rdp")
  assert 0.99 * 8.0 <= direct <= 8.0


def test_noise_is_not_calibrated_for_the_public_steps(ten_dp_steps):
  """All 40 steps at this σ would overspend: the 30 public steps cost
  nothing."""
  ledger, _ = ten_dp_steps
  assert accounting.dpsgd_epsilon(ledger.noise_multiplier, BATCH / N, 40,
                                  1e-4, "rdp") > 8.5


SIGMA_10_FIT = 0.4  # 10 releases fit in ε = 8 at this σ, 20 do not


def test_sigma_04_fits_10_releases_in_epsilon_8_and_not_20():
  eps = lambda k: accounting.dpsgd_epsilon(SIGMA_10_FIT, BATCH / N, k, 1e-4,
                                          "rdp")
  assert eps(10) <= 8.0 < eps(20)


def test_public_steps_do_not_count_against_the_budget():
  """10 DP + 30 public steps at a σ where 10 releases fit and 20 do not:
  accepted, and the plan's releases are the 10 DP steps' alone."""
  ledger, plan = _plan(10, noise_multiplier=SIGMA_10_FIT)
  assert ledger.planned_events(plan.dp_steps) == [
      accounting.PoissonGaussian(BATCH / N, (SIGMA_10_FIT,), 10)]


def test_overspending_dp_steps_refuse_to_start():
  with pytest.raises(ledger_lib.BudgetExceededError, match="refusing"):
    _plan(20, noise_multiplier=SIGMA_10_FIT)


def test_no_dp_step_planned_needs_no_noise_and_no_event():
  ledger, _ = _plan(0)
  assert ledger.noise_multiplier == 0.0 and ledger.planned_events(0) == []


def test_no_dp_step_planned_spends_nothing_saved_or_not():
  ledger, _ = _plan(0)
  assert ledger.epsilon_spent() == 0.0
  assert ledger_lib.PrivacyLedger.from_json(
      json.loads(json.dumps(ledger.to_json()))).epsilon_spent() == 0.0


# --- The non-private update ---------------------------------------------------


@pytest.fixture(scope="module")
def dp_then_public():
  """A DP step (`make_apply`), then a public step on a zero loss; with the
  base optimizer's own update of a zero gradient from the DP step's state."""
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  grads = {"w": jnp.full((2, 3), 0.5), "b": jnp.array([1.0, -2.0, 3.0])}
  base = optax.adamw(1e-2)
  tx = optimizers.dp_optimizer(base, noise_multipliers={"loss": 1.0},
                               sensitivities={"loss": 0.1}, normalizer=16.0)
  state = jax.jit(step_lib.make_apply(tx))(
      state_lib.init_state(params, tx), {"loss": grads},
      secret.RunSecret.pinned(0).noise_key())
  public = jax.jit(step_lib.make_public_step(
      lambda p, ex: 0.0 * jnp.sum(p["w"]) * ex["x"], base, seed=0,
      dropout=False))
  new, _ = public(state, {"x": jnp.ones((1, 2))}, jnp.ones((1, 2)), 0)
  zero = jax.tree.map(jnp.zeros_like, params)
  want_updates, want_base = base.update(zero, state.opt_state, state.params)
  return state, new, want_updates, want_base


def test_dp_step_advances_the_step_and_the_noise_counter(dp_then_public):
  state, _, _, _ = dp_then_public
  assert int(state.noise_count) == int(state.step) == 1


def test_public_step_advances_the_step_but_not_the_noise_counter(
    dp_then_public):
  """So the next release keeps its index."""
  _, new, _, _ = dp_then_public
  assert int(new.noise_count) == 1 and int(new.step) == 2


def test_public_step_continues_the_dp_steps_base_optimizer_state(
    dp_then_public):
  _, new, _, want_base = dp_then_public
  jax.tree.map(np.testing.assert_allclose, new.opt_state, want_base)


def test_public_step_applies_the_base_optimizers_update(dp_then_public):
  state, new, want_updates, _ = dp_then_public
  jax.tree.map(np.testing.assert_allclose, new.params,
               optax.apply_updates(state.params, want_updates))


@pytest.fixture(scope="module")
def least_squares_public_step():
  """`make_public_step` (SGD, lr 0.1) on a least-squares loss over a [2, 3]
  batch of 4 real rows and 2 padding rows holding garbage; with the real
  rows and the initial weights."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(6, 3)), rng.normal(size=6)
  x[4:], y[4:] = 1e6, -1e6  # padding rows
  mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
  example_loss = lambda params, ex: (ex["x"] @ params["w"] - ex["y"]) ** 2
  params = {"w": np.array([0.5, -1.0, 2.0], np.float32)}
  base = optax.sgd(0.1)
  tx = optimizers.dp_optimizer(base, noise_multipliers={"loss": 1.0},
                               sensitivities={"loss": 1.0}, normalizer=4.0)
  state = state_lib.init_state(params, tx)
  step = jax.jit(step_lib.make_public_step(
      example_loss, base, seed=0, dropout=False))
  new, metrics = step(state, {"x": x.reshape(2, 3, 3), "y": y.reshape(2, 3)},
                      mask.reshape(2, 3), 0)
  return new, metrics, x[:4], y[:4], params["w"]


def test_public_step_is_sgd_on_the_mean_gradient_of_the_real_rows(
    least_squares_public_step):
  """Whatever the microbatching."""
  new, _, xr, yr, w = least_squares_public_step
  grad = 2 * xr.T @ (xr @ w - yr) / 4  # grad of mean (x w - y)^2 by hand
  np.testing.assert_allclose(new.params["w"], w - 0.1 * grad, rtol=1e-5)


def test_public_step_reports_the_loss_sum_of_the_real_rows(
    least_squares_public_step):
  _, metrics, xr, yr, w = least_squares_public_step
  np.testing.assert_allclose(metrics["loss_sum"], np.sum((xr @ w - yr) ** 2),
                             rtol=1e-5)


def test_public_step_from_scratch_counts_a_step_and_no_release(
    least_squares_public_step):
  new, _, _, _, _ = least_squares_public_step
  assert int(new.step) == 1 and int(new.noise_count) == 0


# --- Mixed runs of the trainer ------------------------------------------------

TINY = [
    "MIXTURE_OR_TASK_NAME = 'treedst_utterance_lm'",
    "TASK_FEATURE_LENGTHS = {'inputs': 1, 'targets': 32}",
    "GPT2Config.num_layers = 1",
    "INITIAL_CHECKPOINT_PATH = None",  # (the sample's start has 2 layers)
    "BATCH_SIZE = 16",
    "MICROBATCH_SIZE = 8",
    "train.noise_multiplier = 1.0",
    "train.log_period = 100",
    "train.checkpoint_period = 4",
]
REDACTED = ["train.public_task_name = 'smcalflow_utterance_lm'"]
LINEAR6 = [*REDACTED, "train.redaction_schedule = 'linear'", "TRAIN_STEPS = 6"]


@pytest.fixture(scope="module", autouse=True)
def tokenized_once():
  """Every run tokenizes the same two splits: do it once per module."""
  tokenize = data_arrays.load_task_arrays
  load = functools.cache(lambda name, split, lengths, converter: tokenize(
      name, split, dict(lengths), converter=converter))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(data_arrays, "load_task_arrays",
               lambda name, split, lengths, *, converter: load(
                   name, split, tuple(sorted(lengths.items())), converter))
    yield


def run(model_dir, *extra) -> dict:
  gin.clear_config()
  gin_cli.configure(["semparse_sample.gin"],
                    [f"MODEL_DIR = '{model_dir}'", *TINY, *extra])
  try:
    return configurables.train()
  finally:
    gin.clear_config()


def restored_params(model_dir):
  mngr = checkpoints.manager(str(model_dir))
  return checkpoints.restore_params(mngr, mngr.latest_step())


def load_ledger(model_dir) -> dict:
  with open(os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)) as f:
    return json.load(f)


class StepCounter:
  """Counts the batches each sampler hands out (one per step of its kind)
  and can stop the run at a global step, like a kill."""

  def __init__(self, mp, kill_at: int | None = None):
    self.dp, self.public, self.kill_at = 0, 0, kill_at
    for cls, kind in ((sampling.PoissonSampler, "dp"),
                      (sampling.ShuffleSampler, "public")):
      mp.setattr(cls, "microbatches", self._counting(cls.microbatches, kind))

  def _counting(self, original, kind):
    def microbatches(sampler, step, m):
      if self.dp + self.public == self.kill_at:
        raise KeyboardInterrupt("killed")
      setattr(self, kind, getattr(self, kind) + 1)
      return original(sampler, step, m)
    return microbatches


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
  """An uninterrupted 6-step run on the linear schedule."""
  model_dir = tmp_path_factory.mktemp("mixed")
  with pytest.MonkeyPatch.context() as mp:
    counter = StepCounter(mp)
    counter.fit = test_trainer.FitSpy(mp)
    result = run(model_dir, *LINEAR6)
  return model_dir, result, counter


def mixed_meta(mixed):
  _, meta = verify.run_meta(str(mixed[0]))
  return meta


def mixed_ledger(mixed):
  return ledger_lib.PrivacyLedger.from_json(load_ledger(mixed[0]))


def test_mixed_run_takes_both_kinds_of_step(mixed):
  _, _, counter = mixed
  assert 0 < counter.dp < 6 and counter.dp + counter.public == 6


def test_mixed_run_plans_and_reports_the_dp_steps_it_takes(mixed):
  _, result, counter = mixed
  planned = mixed_meta(mixed).plan["redaction"]
  assert planned["dp_steps"] == counter.dp == result["dp_steps"]


def test_mixed_run_plans_and_reports_the_public_steps_it_takes(mixed):
  _, result, counter = mixed
  planned = mixed_meta(mixed).plan["redaction"]
  assert planned["public_steps"] == counter.public == result["public_steps"]


def test_mixed_run_ledger_records_exactly_the_dp_steps(mixed):
  _, _, counter = mixed
  ledger = mixed_ledger(mixed)
  assert ledger.steps == counter.dp
  assert sum(e.count for e in ledger.events) == counter.dp


def test_mixed_run_epsilon_is_dp_accountings_for_the_dp_steps(mixed):
  _, result, counter = mixed
  ledger = mixed_ledger(mixed)
  direct = accounting.dpsgd_epsilon(ledger.noise_multiplier, 16 / 1723,
                                    counter.dp, ledger.delta)
  assert result["epsilon_spent"] == pytest.approx(direct, rel=1e-9)


def test_mixed_run_spends_less_than_all_steps_would(mixed):
  """ε is that of the DP steps only: all 6 would have cost more."""
  _, _, counter = mixed
  ledger = mixed_ledger(mixed)
  direct = accounting.dpsgd_epsilon(ledger.noise_multiplier, 16 / 1723,
                                    counter.dp, ledger.delta)
  assert direct < accounting.dpsgd_epsilon(1.0, 16 / 1723, 6, ledger.delta)


def test_mixed_run_summary_counts_both_kinds_of_step(mixed):
  model_dir, _, counter = mixed
  with open(os.path.join(model_dir, "train_summary.json")) as f:
    summary = json.load(f)
  assert (summary["dp_steps"], summary["public_steps"]) == (
      counter.dp, counter.public)


def test_mixed_run_state_counts_every_step_and_only_dp_releases(mixed):
  """Every step moved the trainer's state, only DP steps drew noise."""
  _, _, counter = mixed
  state = counter.fit.state
  assert int(state.step) == 6
  assert int(state.noise_count) == counter.dp


def test_mixed_run_checkpoints_the_data_position_of_both_kinds(mixed):
  _, _, counter = mixed
  assert dataclasses.asdict(mixed_meta(mixed).data_position) == {
      "step": 6, "seed": 0, "dp_steps": counter.dp,
      "public_steps": counter.public}


@pytest.fixture(scope="module")
def killed_mixed(mixed, tmp_path_factory):
  """The mixed run with the reference's secret (its batches and noise),
  killed at step 5 (the steps it took and its last checkpoint recorded),
  then resumed."""
  reference_dir, _, _ = mixed
  model_dir = tmp_path_factory.mktemp("killed_mixed")
  shutil.copy(os.path.join(reference_dir, secret.SECRET_FILENAME), model_dir)
  with pytest.MonkeyPatch.context() as mp:
    killed = StepCounter(mp, kill_at=5)
    with pytest.raises(KeyboardInterrupt):
      run(model_dir, *LINEAR6)
  checkpoint_step = checkpoints.manager(str(model_dir)).latest_step()
  resumed = run(model_dir, *LINEAR6)
  return model_dir, killed, checkpoint_step, resumed


def test_killed_mixed_run_took_both_kinds_of_step_before_the_kill(
    killed_mixed):
  _, killed, _, _ = killed_mixed
  assert killed.dp > 0 and killed.public > 0


def test_killed_mixed_run_leaves_the_last_periodic_checkpoint(killed_mixed):
  _, _, checkpoint_step, _ = killed_mixed
  assert checkpoint_step == 4


def test_resumed_mixed_run_spends_the_uninterrupted_epsilon(killed_mixed,
                                                            mixed):
  _, _, _, resumed = killed_mixed
  assert resumed["epsilon_spent"] == mixed[1]["epsilon_spent"]


def test_resumed_mixed_run_writes_the_uninterrupted_ledger(killed_mixed,
                                                           mixed):
  model_dir, _, _, _ = killed_mixed
  assert load_ledger(model_dir) == load_ledger(mixed[0])


def test_resumed_mixed_run_ends_with_the_uninterrupted_params(killed_mixed,
                                                              mixed):
  model_dir, _, _, _ = killed_mixed
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               restored_params(mixed[0]))


@pytest.fixture(scope="module")
def redacted_only(tmp_path_factory):
  """p ≡ 1 (Pub+Redacted as a schedule); microbatches of 6 pad the batch of
  16 to 3 x 6 rows."""
  model_dir = tmp_path_factory.mktemp("redacted_only")
  result = run(model_dir, *REDACTED, "TRAIN_STEPS = 3", "MICROBATCH_SIZE = 6",
               "train.redaction_schedule = 'constant'",
               "train.redaction_probability = 1.0")
  return model_dir, result


def test_all_redacted_run_takes_no_dp_step_and_spends_nothing(
    redacted_only):
  _, result = redacted_only
  assert result["epsilon_spent"] == 0.0 and result["dp_steps"] == 0
  assert result["public_steps"] == 3 and result["noise_multiplier"] == 0.0


def test_all_redacted_run_writes_a_valid_empty_ledger(redacted_only):
  model_dir, _ = redacted_only
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))
  assert ledger.events == [] and ledger.steps == 0
  assert ledger.epsilon_spent() == 0.0


@pytest.fixture(scope="module")
def plain_adam(redacted_only):
  """The all-redacted run's initial params and those of `optax.adam` on
  `jax.grad` of the mean batch loss of the same public batches."""
  model_dir, _ = redacted_only
  _, meta = verify.run_meta(str(model_dir))
  config = trainable.config_from_json(meta.model_class, meta.model_config)
  lengths = meta.task_feature_lengths
  model = trainable.trainable(config, lengths)
  initial, _ = model.init_params(jax.random.PRNGKey(0))
  data = data_arrays.load_task_arrays("smcalflow_utterance_lm", "train",
                                      lengths, converter="decoder_only")
  batches = rs.public_sampler(len(data["tokens"]), 16, seed=0)
  adam = optax.adam(1e-2)  # semparse_sample.gin's optimizer and rate

  @jax.jit
  def adam_step(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.mean(model.batch_loss(p, batch)))(params)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = initial, adam.init(initial)
  for i in range(3):
    rows = batches.indices(i)
    params, opt_state = adam_step(params, opt_state,
                                  {k: v[rows] for k, v in data.items()})
  return initial, params


def test_all_redacted_run_is_plain_adam(redacted_only, plain_adam):
  """Its params are those of `optax.adam` on the same public batches from
  the same initial params."""
  _, params = plain_adam
  trained = restored_params(redacted_only[0])
  # Adam's step is lr m / (sqrt(v) + 1e-8): where gradients are ~1e-8,
  # float rounding changes it; 1e-4 is 1% of one step (lr = 1e-2).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4,
                                                       atol=1e-4),
               trained, params)


def test_all_redacted_run_moves_params_far_beyond_the_adam_tolerance(
    redacted_only, plain_adam):
  """The comparison with plain Adam can fail: the params moved."""
  initial, _ = plain_adam
  trained = restored_params(redacted_only[0])
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(),
                       trained, initial)
  assert np.median(jax.tree.leaves(moved)) > 100 * 1e-4  # far beyond atol


@pytest.fixture(scope="module")
def never_and_plain(tmp_path_factory):
  """A plain 2-step DP run, and the p ≡ 0 schedule with its secret (its
  batches and noise)."""
  root = tmp_path_factory.mktemp("never_redacted")
  plain = run(root / "plain", "TRAIN_STEPS = 2")
  (root / "never").mkdir()
  shutil.copy(root / "plain" / secret.SECRET_FILENAME, root / "never")
  never = run(root / "never", *REDACTED, "TRAIN_STEPS = 2",
              "train.redaction_schedule = 'constant'",
              "train.redaction_probability = 0.0")
  return root, never, plain


def test_never_redacted_schedule_takes_only_dp_steps(never_and_plain):
  _, never, plain = never_and_plain
  assert never["dp_steps"] == plain["dp_steps"] == 2


def test_never_redacted_schedule_spends_the_plain_epsilon(never_and_plain):
  _, never, plain = never_and_plain
  assert never["epsilon_spent"] == plain["epsilon_spent"]


def test_never_redacted_schedule_writes_the_plain_ledger(never_and_plain):
  root, _, _ = never_and_plain
  assert load_ledger(root / "never") == load_ledger(root / "plain")


def test_never_redacted_schedule_trains_the_plain_params(never_and_plain):
  root, _, _ = never_and_plain
  jax.tree.map(np.testing.assert_array_equal, restored_params(root / "never"),
               restored_params(root / "plain"))


@pytest.fixture(scope="module")
def jft(redacted_only, tmp_path_factory):
  """JFT: a 1-step DP run at learning rate 0 whose INITIAL_CHECKPOINT_PATH is
  the finished run on redacted data."""
  model_dir = tmp_path_factory.mktemp("jft")
  result = run(model_dir, "TRAIN_STEPS = 1", "LEARNING_RATE = 0.0",
               f"INITIAL_CHECKPOINT_PATH = '{redacted_only[0]}'")
  return model_dir, result


def test_jft_run_takes_its_dp_step(jft):
  assert jft[1]["dp_steps"] == 1


def test_jft_starts_a_dp_run_from_a_redacted_runs_params(jft, redacted_only):
  """Learning rate 0 keeps them."""
  jax.tree.map(np.testing.assert_array_equal, restored_params(jft[0]),
               restored_params(redacted_only[0]))


def test_jft_from_another_architecture_is_refused_before_writing(
    redacted_only, tmp_path):
  source_dir, _ = redacted_only
  never = tmp_path / "never_written"
  with pytest.raises(checkpoints.CheckpointMismatchError, match="d_model"):
    run(never, "TRAIN_STEPS = 1", "GPT2Config.d_model = 32",
        f"INITIAL_CHECKPOINT_PATH = '{source_dir}'")
  assert not never.exists()


def test_public_task_without_a_schedule_is_a_usage_error(tmp_path):
  with pytest.raises(errors.UsageError, match="go together"):
    run(tmp_path / "never_written", *REDACTED, "TRAIN_STEPS = 1")
  assert not (tmp_path / "never_written").exists()
