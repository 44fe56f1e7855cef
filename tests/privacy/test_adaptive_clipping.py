"""Adaptive clipping against explicit loops, fixed-bound DP-SGD and
dp-accounting called directly."""
from __future__ import annotations

import dataclasses
import math
import os

import dp_accounting
from dp_accounting import pld, rdp
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from dpjax import errors
from dpjax.training import plan as plan_lib, state as state_lib
from dpjax.training import step as step_lib
from dpjax.privacy.mechanisms import multi_loss
from dpjax.privacy import accounting, mechanisms
from dpjax.privacy.mechanisms import adaptive_clipping as adaptive
from dpjax.privacy import clipping, clipping_method, noise, sampling
from dpjax.privacy import ledger as ledger_lib, optimizers
from tests.privacy.test_ghost import TOY_BATCH, TOY_PARAMS, toy_loss
from tests.audit import audits

LOSS = multi_loss.LOSS
SECRET = jnp.arange(4, dtype=jnp.uint32)


def unit_step(loss, *, clip_norm: float, noise_multiplier: float,
              normalizer: float, settings: adaptive.AdaptiveClipping | None,
              method: str = "vmap", microbatch_size: int | None = None):
  """(init, accumulate, apply) of one loss, as `step.build_dp_step` builds
  them (adaptive: clipped in units of C; else at `clip_norm`)."""
  mechanism = mechanism_of(settings)
  if settings is not None:
    loss, clip_norm = adaptive.scaled_loss(loss, LOSS), 1.0
  clipped = clipping_method.make_clipped_grad(
      loss, clip_norm=clip_norm, method=method,
      microbatch_size=microbatch_size)
  tx = optimizers.DPOptimizer(mechanism.privatizer(
      sensitivities={LOSS: clip_norm}, noise_multiplier=noise_multiplier,
      normalizer=normalizer), optax.sgd(1.0))
  return (lambda p: state_lib.init_state(p, tx),
          step_lib.flat_metrics(mechanism.accumulate(
              step_lib.make_accumulate(clipped, seed=0, dropout=False))),
          step_lib.make_apply(tx))


def mechanism_of(settings):
  return (mechanisms.DPSGD() if settings is None
          else adaptive.AdaptiveDPSGD(settings=settings))


ADAPTIVE = adaptive.AdaptiveDPSGD()


def loop_reference(params, batch, mask, clip_norm):
  """float64 loop: each real example's gradient clipped to `clip_norm`,
  summed, and the centred count of unclipped examples."""
  total = jax.tree.map(lambda p: np.zeros(np.shape(p)), params)
  count = 0.0
  for i in np.flatnonzero(mask):
    example = jax.tree.map(lambda x: x[i], batch)
    grad = jax.tree.map(lambda g: np.asarray(g, np.float64),
                        jax.grad(toy_loss)(params, example))
    norm = math.sqrt(sum(np.sum(g ** 2) for g in jax.tree.leaves(grad)))
    total = jax.tree.map(lambda t, g: t + g * min(1.0, clip_norm / norm),
                         total, grad)
    count += 0.5 if norm <= clip_norm else -0.5
  return total, count


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_sum_in_units_of_c_and_count_equal_a_float64_loop(method):
  batch = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), TOY_BATCH)
  mask = jnp.array([[1.0, 1.0], [0.0, 1.0]])
  norms = [float(optax.tree.norm(jax.grad(toy_loss)(
      TOY_PARAMS, {"ids": TOY_BATCH["ids"][i]}))) for i in range(4)]
  c = float(np.median(norms))  # some examples clipped, some not
  settings = adaptive.AdaptiveClipping(initial_clip_norm=c, count_stddev=1.0)
  _, accumulate, _ = unit_step(toy_loss, clip_norm=1.0, noise_multiplier=0.0,
                               normalizer=4.0, settings=settings,
                               method=method, microbatch_size=1)
  sums = step_lib.zero_sums(TOY_PARAMS, [LOSS], ADAPTIVE)
  sums, metrics = jax.jit(accumulate)(TOY_PARAMS, sums, batch, mask, 0, 0,
                                      {LOSS: jnp.float32(c)})
  want, count = loop_reference(TOY_PARAMS, TOY_BATCH, mask.reshape(-1), c)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(
      c * np.asarray(g, np.float64), w, rtol=2e-5, atol=1e-6),
               sums[LOSS], want)
  assert float(sums[adaptive.UNCLIPPED][LOSS]) == count
  assert float(metrics["clip_norm"]) == pytest.approx(c)
  real = [n for n, m in zip(norms, mask.reshape(-1)) if m]
  assert float(metrics["grad_norm_p50"]) == pytest.approx(
      np.quantile(real, 0.5), rel=1e-4)  # in the loss's own units


def test_a_step_at_c_is_fixed_dp_sgd_at_c():
  c = 0.3
  fixed = unit_step(toy_loss, clip_norm=c, noise_multiplier=1.3,
                    normalizer=4.0, settings=None)
  adapted = unit_step(
      toy_loss, clip_norm=1.0, noise_multiplier=1.3, normalizer=4.0,
      settings=adaptive.AdaptiveClipping(initial_clip_norm=c,
                                         count_stddev=0.5))
  batch = jax.tree.map(lambda x: x[None], TOY_BATCH)
  mask = jnp.ones((1, 4))
  results = []
  for (init, accumulate, apply), adapts in ((fixed, False), (adapted, True)):
    state = init(TOY_PARAMS)
    sums = step_lib.zero_sums(
        TOY_PARAMS, [LOSS], ADAPTIVE if adapts else mechanisms.DPSGD())
    sums, _ = accumulate(state.params, sums, batch, mask, 0, 0,
                         state.clip_norms)
    results.append(apply(state, sums, SECRET))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-7),
               results[0].params, results[1].params)
  assert results[0].clip_norms is None
  assert float(results[1].clip_norms[LOSS]) != c  # and the bound moved


def test_count_release_is_the_count_plus_its_gaussian_on_its_own_keys():
  count, stddev, normalizer = jnp.float32(3.5), 2.0, 10.0
  releases = jnp.arange(4000)
  fractions = jax.vmap(lambda r: adaptive.noisy_unclipped_fraction(
      count, adaptive.count_keys(SECRET, r, 0), stddev, normalizer))(releases)
  draws = (np.asarray(fractions, np.float64) - 0.5) * normalizer - 3.5
  assert abs(draws.mean()) < 4 * stddev / math.sqrt(len(draws))
  assert draws.std() == pytest.approx(stddev, rel=0.05)
  # Apart from the gradient noise of the same release, and per loss.
  keys = {tuple(np.asarray(jax.random.key_data(k)).ravel()) for k in (
      noise.noise_key(SECRET, 7), adaptive.count_keys(SECRET, 7, 0),
      adaptive.count_keys(SECRET, 7, 1))}
  assert len(keys) == 3


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_clip_norm_follows_the_target_quantile(target):
  """Gradients x of w·x, their norms lognormal: C settles at the target
  quantile of the norm distribution, with the paper's count noise."""
  batch_size, steps = 64, 300
  settings = adaptive.AdaptiveClipping(
      initial_clip_norm=0.1, target_quantile=target).resolved(batch_size)
  init, accumulate, apply = unit_step(
      lambda w, ex: jnp.sum(w * ex["x"]), clip_norm=1.0,
      noise_multiplier=1.0, normalizer=batch_size, settings=settings)
  rng = np.random.default_rng(0)
  norms = rng.lognormal(0.0, 0.5, size=(steps, batch_size))
  directions = rng.normal(size=(steps, batch_size, 3))
  x = directions / np.linalg.norm(directions, axis=-1, keepdims=True)
  x = jnp.asarray(x * norms[..., None], jnp.float32)
  mask = jnp.ones((1, batch_size))

  def step(state, x_t):
    sums = step_lib.zero_sums(state.params, [LOSS], ADAPTIVE)
    sums, _ = accumulate(state.params, sums, {"x": x_t[None]}, mask, 0, 0,
                         state.clip_norms)
    state = apply(state, sums, SECRET)
    return state, state.clip_norms[LOSS]

  _, history = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(
      init(jnp.zeros(3)), x)
  settled = float(np.mean(np.asarray(history)[-100:]))
  want = math.exp(0.5 * math.sqrt(2) * _erfinv(2 * target - 1))
  assert settled == pytest.approx(want, rel=0.1)
  assert float(history[0]) < 0.2 < want  # it had to travel


def _erfinv(y: float) -> float:
  return float(jax.scipy.special.erfinv(y))


def test_each_named_loss_is_clipped_at_its_own_bound():
  losses = lambda p, ex: {"a": jnp.sum(p["w"] * ex["x"]),
                          "b": 10 * p["v"] * ex["x"][0]}
  params = {"w": jnp.zeros(2), "v": jnp.zeros(())}
  batch = {"x": jnp.array([[3.0, 4.0], [0.1, 0.1], [0.3, 0.0]])}
  mask = jnp.ones(3)
  bounds = {"a": 0.5, "b": 2.0}
  fixed, fixed_stats = clipping.multi_loss_clipped_grad(
      losses, clip_norms=bounds)(params, batch, mask)
  unit, stats = clipping.multi_loss_clipped_grad(
      adaptive.scaled_losses(losses, ["a", "b"]),
      clip_norms={"a": 1.0, "b": 1.0}, microbatch_size=1)(
          params, adaptive.with_inverse_clip_norms(batch, bounds, mask), mask)
  for name, c in bounds.items():
    jax.tree.map(lambda u, f: np.testing.assert_allclose(c * u, f, rtol=1e-6),
                 unit[name], fixed[name])
    assert int(stats[name].num_clipped) == int(fixed_stats[name].num_clipped)
  assert [int(stats[k].num_clipped) for k in bounds] == [1, 2]


N, BATCH, STEPS = 800, 40, 12


def adaptive_plan(accountant, **settings):
  sampler = sampling.PoissonSampler(N, BATCH, seed=0)
  resolved = adaptive.AdaptiveClipping(**settings).resolved(BATCH)
  ledger, plan = plan_lib.plan_privacy(
      sampler, saved_meta=None, steps=STEPS, batch_size=BATCH,
      sampling_method="poisson", clip_norm=resolved.initial_clip_norm,
      delta=1 / N, target_epsilon=2.0, noise_multiplier=None,
      accountant=accountant, seed=0,
      mechanism=adaptive.AdaptiveDPSGD(settings=resolved))
  ledger.record_dp_steps(STEPS,
                         noise_multipliers=plan_lib.plan_multipliers(plan))
  return ledger, plan


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_ledger_epsilon_is_dp_accountings_for_gradient_and_count(accountant):
  ledger, plan = adaptive_plan(accountant)
  sigma, count_multiplier = plan.noise_multiplier, 2 * BATCH / 20
  assert plan_lib.plan_multipliers(plan) == (sigma, count_multiplier)
  assert [e.to_json() for e in ledger.events] == [{
      "type": "poisson_gaussian", "sampling_rate": BATCH / N,
      "noise_multipliers": [sigma, count_multiplier], "count": STEPS}]
  q = BATCH / N
  if accountant == "rdp":  # the composed mechanism as it is
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(sigma),
         dp_accounting.GaussianDpEvent(count_multiplier)]))
    direct = rdp.RdpAccountant(orders=accounting.RDP_ORDERS)
  else:  # PLD takes one Gaussian: the paper's (σ^-2 + (2σ_b)^-2)^-1/2
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(
        (sigma ** -2 + count_multiplier ** -2) ** -0.5))
    direct = pld.PLDAccountant(
        value_discretization_interval=accounting.PLD_VALUE_DISCRETIZATION_INTERVAL)
  want = direct.compose(dp_accounting.SelfComposedDpEvent(event, STEPS)
                        ).get_epsilon(1 / N)
  assert ledger.epsilon_spent() == pytest.approx(want, rel=1e-9)
  assert 0.99 * 2.0 <= ledger.epsilon_spent() <= 2.0  # calibrated with it


def test_the_count_costs_gradient_noise():
  without = accounting.calibrate(2.0, 1 / N, sampling.PoissonSampler(
      N, BATCH, seed=0).scheme, [STEPS], accountant="rdp")
  _, plan = adaptive_plan("rdp", count_stddev=0.5)
  assert plan.noise_multiplier > 1.01 * without


def test_a_count_that_spends_the_budget_alone_is_refused():
  with pytest.raises(errors.UsageError, match="count_stddev"):
    adaptive_plan("rdp", count_stddev=0.01)


def test_the_plan_keeps_the_settings_and_old_plans_stay_compatible():
  _, plan = adaptive_plan("rdp", target_quantile=0.7)
  assert plan.guarantee()["adaptive_clipping"] == {
      "initial_clip_norm": 0.1, "target_quantile": 0.7, "learning_rate": 0.2,
      "count_stddev": BATCH / 20}
  assert "adaptive_clipping" not in dataclasses.replace(
      plan, mechanism=mechanisms.DPSGD()).guarantee()


@pytest.mark.parametrize("bad", [dict(initial_clip_norm=0.0),
                                 dict(target_quantile=1.0),
                                 dict(learning_rate=-1.0),
                                 dict(count_stddev=0.0)])
def test_bad_settings_are_refused(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    adaptive.AdaptiveClipping(**bad)


ADAPTIVE_RUN = ["TRAIN_STEPS = 4", "train.checkpoint_period = 2",
                "train.clip_norm = 'adaptive'",
                "adaptive_clipping.initial_clip_norm = 0.5"]


@pytest.fixture(scope="module")
def adaptive_runs(tmp_path_factory):
  """The quickstart (tiny T5, ghost clipping, microbatches) with adaptive
  clipping for 4 steps; the same run killed at step 3 and resumed."""
  from tests import test_trainer
  reference = tmp_path_factory.mktemp("adaptive")
  result = test_trainer.run(reference, *ADAPTIVE_RUN)
  killed = tmp_path_factory.mktemp("adaptive_killed")
  test_trainer.run_killed_at(3, reference, killed, *ADAPTIVE_RUN)
  resumed = test_trainer.run(killed, *ADAPTIVE_RUN)
  return reference, result, killed, resumed


def test_a_training_run_records_the_counts_and_moves_the_bound(adaptive_runs):
  reference, result, _, _ = adaptive_runs
  ledger = _ledger(reference)
  (event,) = ledger.events
  assert event.noise_multipliers == pytest.approx(
      (result["noise_multiplier"], 2 * 16 / 20))  # BATCH_SIZE / 20, doubled
  assert event.count == 4
  assert result["epsilon_spent"] == pytest.approx(accounting.epsilon(
      [accounting.PoissonGaussian(event.sampling_rate,
                                  event.noise_multipliers, 4)],
      ledger.delta, "pld"), rel=1e-12)
  assert result["clip_norm"] != pytest.approx(0.5)


def test_a_resumed_run_continues_from_the_checkpointed_bound(adaptive_runs):
  from tests import test_trainer
  reference, result, killed, resumed = adaptive_runs
  assert resumed["clip_norm"] == result["clip_norm"]
  assert (test_trainer.load_ledger_json(killed)
          == test_trainer.load_ledger_json(reference))
  jax.tree.map(np.testing.assert_array_equal,
               test_trainer.restored_params(killed),
               test_trainer.restored_params(reference))


def _ledger(model_dir):
  return ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))


def test_a_two_loss_step_moves_each_bound_by_its_own_count():
  """`step.build_dp_step` on a model with two named losses: each loss's
  release is its fixed-bound clipped sum at its C, and each C moves by its
  own fraction of unclipped examples."""
  import types
  losses = lambda p, ex: {"a": jnp.sum(p["w"] * ex["x"]),
                          "b": 10 * p["v"] * ex["x"][0]}
  params = {"w": jnp.zeros(2), "v": jnp.zeros(())}
  model = types.SimpleNamespace(
      example_loss=None, example_losses=losses, loss_names=("a", "b"),
      trainable_mask=None, example_rng=False,
      abstract_params=lambda: (params, {"w": P("embed"), "v": P()}))
  settings = adaptive.AdaptiveClipping(initial_clip_norm=1.0,
                                       count_stddev=1e-6)
  tx, accumulate, apply = step_lib.build_dp_step(
      model, clip_norm=1.0, optimizer="sgd", learning_rate=1.0,
      noise_multiplier=0.0, normalizer=3.0, seed=0, clipping_method="vmap",
      mechanism=adaptive.AdaptiveDPSGD(settings=settings))
  batch = {"x": jnp.array([[[3.0, 4.0], [0.2, 0.1], [0.03, 0.0]]])}
  mask = jnp.ones((1, 3))
  state = state_lib.init_state(params, tx)
  assert set(state.clip_norms) == {"a", "b"}
  sums = step_lib.zero_sums(params, ["a", "b"], ADAPTIVE)
  sums, _ = accumulate(params, sums, batch, mask, 0, 0, state.clip_norms)
  new = apply(state, sums, SECRET)
  fixed, stats = clipping.multi_loss_clipped_grad(
      losses, clip_norms={"a": 1.0, "b": 1.0})(params, {"x": batch["x"][0]},
                                               mask[0])
  want = jax.tree.map(lambda a, b: -(a + b) / 3.0, fixed["a"], fixed["b"])
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6),
               new.params, want)
  for name in ("a", "b"):  # a: norms 5, 0.22, 0.03; b: 30, 2, 0.3
    unclipped = 3 - int(stats[name].num_clipped)
    assert float(new.clip_norms[name]) == pytest.approx(
        math.exp(-0.2 * (unclipped / 3 - 0.5)), rel=1e-5)
  assert float(new.clip_norms["a"]) != float(new.clip_norms["b"])


def test_an_audit_of_this_run_stays_at_or_below_its_epsilon(tmp_path):
  """`audits.AUDITS` audits (`python -m dpjax.audit`, fresh secrets) of
  the adaptive run at ε = 3: each canary enters at the step's bound
  (tests/audit)."""
  from tests import test_trainer
  bindings = [b.replace(" = ", "=", 1)
              for b in [*test_trainer.TINY, *ADAPTIVE_RUN]]
  audits.assert_honest(audits.honest_audits(
      tmp_path, "quickstart.gin", *bindings, *audits.SMALL_T5,
      "TRAIN_STEPS=2"),
      "adaptive clipping")
