"""The redaction schedule (shared/papers/004): p(t), the public coin flips,
the non-private step on redacted data, and mixed runs of `dpjax.train`.

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
from jax.experimental.compilation_cache import compilation_cache

from dpjax import checkpoints, gin_cli, plan as plan_lib, train_step, trainer
from dpjax.data import arrays as data_arrays
from dpjax.models import trainable
from dpjax.privacy import accounting, ledger as ledger_lib
from dpjax.privacy import optimizers, sampling
from dpjax.privacy import redaction_schedule as rs
from tests import test_trainer
from dpjax.privacy import secret

# --- The schedules ------------------------------------------------------------


def test_schedules_match_the_paper_formulas_by_hand():
  T, eta = 10, 15.0
  p = lambda name: rs.probabilities(name, T, eta=eta)
  np.testing.assert_allclose(p("linear")[[0, 5, 9]], [1.0, 0.5, 0.1])
  np.testing.assert_array_equal(p("step"), [1] * 5 + [0] * 5)
  np.testing.assert_array_equal(rs.probabilities("step", 5), [1, 1, 1, 0, 0])
  # exp_concave: 1 - exp((eta / T)(t - T)); exp_convex: exp(-eta t / T).
  np.testing.assert_allclose(
      p("exp_concave")[[0, 5, 9]],
      [1 - math.exp(-15.0), 1 - math.exp(-7.5), 1 - math.exp(-1.5)],
      rtol=1e-12)
  np.testing.assert_allclose(
      p("exp_convex")[[0, 5, 9]],
      [1.0, math.exp(-7.5), math.exp(-13.5)], rtol=1e-12)
  np.testing.assert_array_equal(
      rs.probabilities("constant", 4, p=0.25), [0.25] * 4)
  for name in ("linear", "step", "exp_convex", "exp_concave"):
    assert np.all(np.diff(p(name)) <= 0), name  # never back to redacted data
  # A hotter eta keeps exp_concave near 1 longer and drops exp_convex faster.
  assert np.all(rs.probabilities("exp_concave", T, eta=30) > p("exp_concave"))
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


def test_coin_flips_are_seeded_public_randomness_with_mean_sum_p():
  probs = rs.probabilities("linear", 20_000)
  coins = rs.public_steps(probs, seed=3)
  np.testing.assert_array_equal(coins, rs.public_steps(probs, seed=3))
  assert not np.array_equal(coins, rs.public_steps(probs, seed=4))
  # Independent Bernoulli(p(t)) coins: the count is within 5 sd of sum p(t).
  sd = math.sqrt(np.sum(probs * (1 - probs)))
  assert abs(coins.sum() - probs.sum()) < 5 * sd
  # Early steps mostly redacted, late steps mostly DP, as p(t) says.
  assert coins[:2000].mean() > 0.85 and coins[-2000:].mean() < 0.15
  # Coin t depends on (seed, t) only, not on T.
  half = np.full(50, 0.5)
  np.testing.assert_array_equal(rs.public_steps(half, 9),
                                rs.public_steps(np.full(80, 0.5), 9)[:50])
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


def test_noise_is_calibrated_for_the_planned_dp_steps_only():
  ledger, plan = _plan(10)
  assert plan.dp_steps == 10 and plan.steps == 40
  direct = accounting.dpsgd_epsilon(ledger.noise_multiplier, BATCH / N, 10,
                                    1e-4, "rdp")
  assert 0.99 * 8.0 <= direct <= 8.0
  # All 40 steps at this σ would overspend: the 30 public steps cost nothing.
  assert accounting.dpsgd_epsilon(ledger.noise_multiplier, BATCH / N, 40,
                                  1e-4, "rdp") > 8.5


def test_overspending_dp_steps_refuse_to_start_and_public_steps_do_not():
  sigma = 0.4  # 10 releases fit in ε = 8 at this σ, 20 do not
  eps = lambda k: accounting.dpsgd_epsilon(sigma, BATCH / N, k, 1e-4, "rdp")
  assert eps(10) <= 8.0 < eps(20)
  _plan(10, noise_multiplier=sigma)  # 10 DP + 30 public steps: fine
  with pytest.raises(ledger_lib.BudgetExceededError, match="refusing"):
    _plan(20, noise_multiplier=sigma)


def test_no_dp_step_planned_needs_no_noise_and_spends_nothing():
  ledger, plan = _plan(0)
  assert ledger.noise_multiplier == 0.0 and ledger.planned_events(0) == []
  assert ledger.epsilon_spent() == 0.0
  assert ledger_lib.PrivacyLedger.from_json(
      json.loads(json.dumps(ledger.to_json()))).epsilon_spent() == 0.0


# --- The non-private update ---------------------------------------------------


def test_dp_and_public_steps_share_the_base_state_and_only_dp_counts():
  """A DP step (`make_apply`) advances the base optimizer and the noise
  counter; a public step after it runs the same base optimizer on the same
  state (here on a zero loss: the base's own update of a zero gradient) and
  leaves the counter, so the next release keeps its index."""
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  grads = {"w": jnp.full((2, 3), 0.5), "b": jnp.array([1.0, -2.0, 3.0])}
  base = optax.adamw(1e-2)
  tx = optimizers.dp_optimizer(base, noise_multipliers={"loss": 1.0},
                               sensitivities={"loss": 0.1}, normalizer=16.0)
  state = jax.jit(train_step.make_apply(tx))(
      train_step.init_state(params, tx), {"loss": grads},
      secret.RunSecret.pinned(0).noise_key())
  assert int(state.noise_count) == int(state.step) == 1
  public = jax.jit(train_step.make_public_step(
      lambda p, ex: 0.0 * jnp.sum(p["w"]) * ex["x"], base, seed=0,
      dropout=False))
  new, _ = public(state, {"x": jnp.ones((1, 2))}, jnp.ones((1, 2)), 0)
  zero = jax.tree.map(jnp.zeros_like, params)
  want_updates, want_base = base.update(zero, state.opt_state, state.params)
  assert int(new.noise_count) == 1 and int(new.step) == 2
  jax.tree.map(np.testing.assert_allclose, new.opt_state, want_base)
  jax.tree.map(np.testing.assert_allclose, new.params,
               optax.apply_updates(state.params, want_updates))


def test_public_step_is_sgd_on_the_mean_gradient_of_the_real_rows():
  """`make_public_step` on a least-squares loss: the mean over the real rows
  of a [K, m] batch (padding rows hold garbage), whatever the microbatching."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(6, 3)), rng.normal(size=6)
  x[4:], y[4:] = 1e6, -1e6  # padding rows
  mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
  example_loss = lambda params, ex: (ex["x"] @ params["w"] - ex["y"]) ** 2
  params = {"w": np.array([0.5, -1.0, 2.0], np.float32)}
  base = optax.sgd(0.1)
  tx = optimizers.dp_optimizer(base, noise_multipliers={"loss": 1.0},
                               sensitivities={"loss": 1.0}, normalizer=4.0)
  state = train_step.init_state(params, tx)
  step = jax.jit(train_step.make_public_step(
      example_loss, base, seed=0, dropout=False))
  new, metrics = step(state, {"x": x.reshape(2, 3, 3), "y": y.reshape(2, 3)},
                      mask.reshape(2, 3), 0)
  xr, yr = x[:4], y[:4]  # by hand: grad of mean (x w - y)^2 = 2 x^T r / 4
  grad = 2 * xr.T @ (xr @ params["w"] - yr) / 4
  np.testing.assert_allclose(new.params["w"], params["w"] - 0.1 * grad,
                             rtol=1e-5)
  np.testing.assert_allclose(metrics["loss_sum"],
                             np.sum((xr @ params["w"] - yr) ** 2), rtol=1e-5)
  assert int(new.step) == 1 and int(new.noise_count) == 0


# --- Mixed runs of the trainer ------------------------------------------------

TINY = [
    "MIXTURE_OR_TASK_NAME = 'treedst_utterance_lm'",
    "TASK_FEATURE_LENGTHS = {'inputs': 1, 'targets': 32}",
    "GPT2Config.num_layers = 1",
    "BATCH_SIZE = 16",
    "MICROBATCH_SIZE = 8",
    "train.noise_multiplier = 1.0",
    "train.log_period = 100",
    "train.checkpoint_period = 4",
]
REDACTED = ["train.public_task_name = 'smcalflow_utterance_lm'"]
LINEAR6 = [*REDACTED, "train.redaction_schedule = 'linear'", "TRAIN_STEPS = 6"]


@pytest.fixture(scope="module", autouse=True)
def compiled_once(tmp_path_factory):
  """The runs below compile the same steps (a new closure per run): keep
  XLA's executables in a persistent cache for this module only."""
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir",
                    str(tmp_path_factory.mktemp("xla_cache")))
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", previous)
  compilation_cache.reset_cache()


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
    return trainer.train()
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


def test_mixed_run_records_exactly_the_dp_steps_it_takes(mixed):
  model_dir, result, counter = mixed
  _, meta = checkpoints.latest_meta(checkpoints.manager(str(model_dir)))
  planned = meta.plan["redaction"]
  assert 0 < counter.dp < 6 and counter.dp + counter.public == 6
  assert planned["dp_steps"] == counter.dp == result["dp_steps"]
  assert planned["public_steps"] == counter.public == result["public_steps"]
  ledger = ledger_lib.PrivacyLedger.from_json(load_ledger(model_dir))
  assert ledger.steps == counter.dp
  assert sum(e.count for e in ledger.events) == counter.dp
  direct = accounting.dpsgd_epsilon(ledger.noise_multiplier, 16 / 1723,
                                    counter.dp, ledger.delta)
  assert result["epsilon_spent"] == pytest.approx(direct, rel=1e-9)
  # ε is that of the DP steps only: all 6 would have cost more.
  assert direct < accounting.dpsgd_epsilon(1.0, 16 / 1723, 6, ledger.delta)
  with open(os.path.join(model_dir, "train_summary.json")) as f:
    summary = json.load(f)
  assert (summary["dp_steps"], summary["public_steps"]) == (
      counter.dp, counter.public)
  # The trainer's state: every step moved it, only DP steps drew noise.
  state = counter.fit.state
  assert int(state.step) == 6
  assert int(state.noise_count) == counter.dp
  assert dataclasses.asdict(meta.data_position) == {"step": 6, "seed": 0,
                                   "dp_steps": counter.dp,
                                   "public_steps": counter.public}


def test_killed_mixed_run_resumes_bit_exactly(mixed, tmp_path):
  reference_dir, reference, _ = mixed
  model_dir = tmp_path / "killed"
  model_dir.mkdir()  # the reference's secret: its batches and noise
  shutil.copy(os.path.join(reference_dir, secret.SECRET_FILENAME), model_dir)
  with pytest.MonkeyPatch.context() as mp:
    killed = StepCounter(mp, kill_at=5)
    with pytest.raises(KeyboardInterrupt):
      run(model_dir, *LINEAR6)
  assert killed.dp > 0 and killed.public > 0  # both kinds before the kill
  assert checkpoints.manager(str(model_dir)).latest_step() == 4
  resumed = run(model_dir, *LINEAR6)
  assert resumed["epsilon_spent"] == reference["epsilon_spent"]
  assert load_ledger(model_dir) == load_ledger(reference_dir)
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               restored_params(reference_dir))


@pytest.fixture(scope="module")
def redacted_only(tmp_path_factory):
  """p ≡ 1 (Pub+Redacted as a schedule); microbatches of 6 pad the batch of
  16 to 3 x 6 rows."""
  model_dir = tmp_path_factory.mktemp("redacted_only")
  result = run(model_dir, *REDACTED, "TRAIN_STEPS = 3", "MICROBATCH_SIZE = 6",
               "train.redaction_schedule = 'constant'",
               "train.redaction_probability = 1.0")
  return model_dir, result


def test_all_redacted_run_spends_nothing_and_is_plain_adam(redacted_only):
  """No DP step: ε = 0 and a valid empty ledger; the params are those of
  `optax.adam` on `jax.grad` of the mean batch loss of the same public
  batches, from the same initial params."""
  model_dir, result = redacted_only
  assert result["epsilon_spent"] == 0.0 and result["dp_steps"] == 0
  assert result["public_steps"] == 3 and result["noise_multiplier"] == 0.0
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))
  assert ledger.events == [] and ledger.steps == 0
  assert ledger.epsilon_spent() == 0.0

  _, meta = checkpoints.latest_meta(checkpoints.manager(str(model_dir)))
  config = trainable.config_from_json(meta.model_class, meta.model_config)
  lengths = meta.task_feature_lengths
  model = trainable.trainable(config, lengths)
  initial, _ = model.init_params(jax.random.PRNGKey(0))
  data = data_arrays.load_task_arrays("smcalflow_utterance_lm", "train",
                                      lengths, converter="decoder_only")
  batches = plan_lib.public_sampler(len(data["tokens"]), 16, seed=0)
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
  trained = restored_params(model_dir)
  # Adam's step is lr m / (sqrt(v) + 1e-8): where gradients are ~1e-8,
  # float rounding changes it; 1e-4 is 1% of one step (lr = 1e-2).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4,
                                                       atol=1e-4),
               trained, params)
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(),
                       trained, initial)
  assert np.median(jax.tree.leaves(moved)) > 100 * 1e-4  # far beyond atol


def test_never_redacted_schedule_is_the_plain_dp_run(tmp_path):
  plain = run(tmp_path / "plain", "TRAIN_STEPS = 2")
  (tmp_path / "never").mkdir()  # plain's secret: its batches and noise
  shutil.copy(tmp_path / "plain" / secret.SECRET_FILENAME, tmp_path / "never")
  never = run(tmp_path / "never", *REDACTED, "TRAIN_STEPS = 2",
              "train.redaction_schedule = 'constant'",
              "train.redaction_probability = 0.0")
  assert never["dp_steps"] == plain["dp_steps"] == 2
  assert never["epsilon_spent"] == plain["epsilon_spent"]
  assert load_ledger(tmp_path / "never") == load_ledger(tmp_path / "plain")
  jax.tree.map(np.testing.assert_array_equal,
               restored_params(tmp_path / "never"),
               restored_params(tmp_path / "plain"))


def test_jft_starts_a_dp_run_from_a_redacted_run(redacted_only, tmp_path):
  """JFT: a DP run whose INITIAL_CHECKPOINT_PATH is a finished run on
  redacted data starts from that run's params (learning rate 0 keeps them);
  another architecture is refused before anything is written."""
  source_dir, _ = redacted_only
  result = run(tmp_path / "jft", "TRAIN_STEPS = 1", "LEARNING_RATE = 0.0",
               f"INITIAL_CHECKPOINT_PATH = '{source_dir}'")
  assert result["dp_steps"] == 1
  jax.tree.map(np.testing.assert_array_equal,
               restored_params(tmp_path / "jft"), restored_params(source_dir))
  never = tmp_path / "never_written"
  with pytest.raises(checkpoints.CheckpointMismatchError, match="d_model"):
    run(never, "TRAIN_STEPS = 1", "GPT2Config.d_model = 32",
        f"INITIAL_CHECKPOINT_PATH = '{source_dir}'")
  assert not never.exists()


def test_public_task_without_a_schedule_is_a_usage_error(tmp_path):
  with pytest.raises(gin_cli.UsageError, match="go together"):
    run(tmp_path / "never_written", *REDACTED, "TRAIN_STEPS = 1")
  assert not (tmp_path / "never_written").exists()
