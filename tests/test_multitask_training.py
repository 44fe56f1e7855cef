"""Two clipped-and-noised releases per step (GPT-2 + discriminator head,
an ICLR 2023 submission, OpenReview LUql3ZOFwFD): each release clips its own
loss, is noised with its own independent draw, and both are counted in ε. The
end-to-end trainer run is in tests/textcls/test_experiment.py."""
import functools
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import rdp

from dpjax import errors
from dpjax.training import plan as plan_lib, step as step_lib
from dpjax.models import gpt2, gpt2_disc, trainable
from dpjax.privacy import accounting, clipping, noise, optimizers, sampling
from dpjax.privacy.mechanisms import multi_loss
from dpjax.privacy.secret import RunSecret

LENGTH = 10
LABELS = (58, 59)
LENGTHS = {"inputs": 3, "targets": LENGTH - 3}


def _config(**kw):
  lm = gpt2.GPT2Config(vocab_size=61, n_positions=16, d_model=16, num_layers=2,
                       num_heads=2, dropout_rate=0.0)
  return gpt2_disc.GPT2DiscConfig(lm=lm, label_token_ids=LABELS, head_hidden=8, **kw)


@pytest.fixture(scope="module")
def model():
  config = _config(frozen_layers=(0,))
  params, _ = gpt2_disc.init_params(config, jax.random.PRNGKey(0), max_length=LENGTH)
  rng = np.random.default_rng(0)
  n = 4
  tokens = rng.integers(0, 57, (n, LENGTH)).astype(np.int32)
  tokens[:, 0], tokens[:, 1], tokens[:, 2] = 60, np.array(LABELS)[rng.integers(0, 2, n)], 57
  lengths = np.array([LENGTH, 6, 8, 5])
  mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
  weights = mask * (np.arange(LENGTH)[None] >= 3)
  batch = {"tokens": tokens, "attention_mask": mask, "loss_weights": weights.astype(np.float32),
           "dropout_rng": jax.random.split(jax.random.PRNGKey(1), n)}
  return config, params, batch, np.array([1.0, 1.0, 1.0, 0.0], np.float32)


BOUNDS = {"lm": 0.05, "disc": 0.01}


@pytest.fixture(scope="module")
def clipped(model):
  """The two-loss clipped sums of the model's batch (bounds BOUNDS), and the
  reference: an explicit loop over the real examples and the two losses,
  each gradient taken w.r.t. all params, frozen leaves then zeroed, giving
  each example's norm and each loss's clipped sum."""
  config, params, batch, mask = model
  trains = gpt2_disc.trainable_mask(config, params)
  losses = gpt2_disc.make_example_losses(config)
  f = clipping.multi_loss_clipped_grad(losses, clip_norms=BOUNDS,
                                       trainable=trains)
  sums, stats = jax.jit(f)(params, batch, mask)
  grads = jax.jit(jax.jacrev(losses))  # {name: gradient}, one example
  per_example = [grads(params, jax.tree.map(lambda x: x[i], batch))
                 for i in np.flatnonzero(mask)]
  norms, expected = {}, {}
  for name, bound in BOUNDS.items():
    norms[name], expected[name] = {}, jax.tree.map(np.zeros_like, params)
    for i in np.flatnonzero(mask):
      g = per_example[i][name]
      g = jax.tree.map(lambda x, t: np.asarray(x) * t, g, trains)
      norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in jax.tree.leaves(g)))
      norms[name][i] = norm
      expected[name] = jax.tree.map(
          lambda e, x: e + x * min(1.0, bound / norm), expected[name], g)
  return f, sums, stats, norms, expected


def test_each_loss_has_its_own_sensitivity(clipped):
  f, _, _, _, _ = clipped
  assert f.sensitivities == BOUNDS


@pytest.mark.parametrize("name", BOUNDS)
def test_each_release_reports_each_examples_own_norm(clipped, name):
  _, _, stats, norms, _ = clipped
  assert norms[name]
  for i, norm in norms[name].items():
    assert stats[name].norms[i] == pytest.approx(norm, rel=1e-4)


@pytest.mark.parametrize("name", BOUNDS)
def test_each_release_clips_its_own_loss_gradient(clipped, name):
  _, sums, _, _, expected = clipped
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8),
      sums[name], expected[name])


@pytest.mark.parametrize("name", BOUNDS)
def test_each_release_skips_frozen_leaves(clipped, name):
  """The frozen block's leaves are exactly zero in both sums."""
  _, sums, _, _, _ = clipped
  assert all(np.all(np.asarray(x) == 0)
             for x in jax.tree.leaves(sums[name]["layers_0"]))


@pytest.mark.parametrize("name", BOUNDS)
def test_each_release_leaves_out_the_padding_row(clipped, name):
  _, _, stats, _, _ = clipped
  assert stats[name].norms[3] == 0 and int(stats[name].num_examples) == 3


def test_the_lm_release_has_no_head_gradient(clipped):
  """The two losses differ, so do their sums."""
  _, sums, _, _, _ = clipped
  assert all(np.all(np.asarray(x) == 0)
             for x in jax.tree.leaves(sums["lm"]["disc_head"]))


def test_the_disc_release_has_a_head_gradient(clipped):
  _, sums, _, _, _ = clipped
  assert any(np.any(np.asarray(x) != 0)
             for x in jax.tree.leaves(sums["disc"]["disc_head"]))


@pytest.fixture(scope="module")
def two_releases_noised():
  """Zero sums of two losses at sensitivities 1 and 3, σ = 1, privatized
  at release 0 and 1; one leaf frozen."""
  params = {"w": jnp.zeros(40_000), "frozen": jnp.zeros(50)}
  trains = {"w": True, "frozen": False}
  zeros = jax.tree.map(jnp.zeros_like, params)
  privatize = noise.privatizer(noise_multipliers={"lm": 1.0, "disc": 1.0},
                               sensitivities={"lm": 1.0, "disc": 3.0}, normalizer=1.0,
                               trainable=trains)
  key = RunSecret.pinned(3).noise_key()
  first = privatize({"lm": zeros, "disc": zeros}, 0, key)
  second = privatize({"lm": zeros, "disc": zeros}, 1, key)
  return first, second


@pytest.mark.parametrize("release", [0, 1])
def test_each_release_gets_its_own_independent_noise(two_releases_noised,
                                                     release):
  """Independent draws add up to variance 1 + 9 = 10 (the same draw reused
  would give (1 + 3)² = 16, one release at the larger bound 9)."""
  update = two_releases_noised[release]
  assert np.std(np.asarray(update["w"])) == pytest.approx(math.sqrt(10),
                                                          rel=0.02)


@pytest.mark.parametrize("release", [0, 1])
def test_frozen_leaves_get_no_noise(two_releases_noised, release):
  update = two_releases_noised[release]
  assert np.all(np.asarray(update["frozen"]) == 0)


def test_noise_is_fresh_at_each_step(two_releases_noised):
  first, second = two_releases_noised
  assert abs(np.corrcoef(first["w"], second["w"])[0, 1]) < 0.03


def test_frozen_leaves_are_not_updated_even_with_weight_decay():
  params = {"w": jnp.ones(3), "frozen": jnp.ones(2)}
  trains = {"w": True, "frozen": False}
  tx = optimizers.dp_optimizer(
      optimizers.freeze(optax.adamw(0.1, weight_decay=0.5), trains),
      noise_multipliers={"lm": 1.0}, sensitivities={"lm": 1.0}, normalizer=1.0,
      trainable=trains)
  grads = {"lm": {"w": jnp.ones(3), "frozen": jnp.zeros(2)}}
  updates, *_ = tx.update(grads, tx.init(params), params, count=0,
                            noise_secret=RunSecret.pinned(0).noise_key())
  assert np.all(np.asarray(updates["frozen"]) == 0)
  assert np.all(np.asarray(updates["w"]) != 0)  # the trainable ones are


@pytest.fixture(scope="module")
def two_release_plan():
  """σ calibrated for T steps of two Gaussians on one Poisson sample: the
  ledger after them, the plan, and dp-accounting's ε of 1 or 2 releases at
  that σ, built here directly."""
  n, batch, steps, delta = 800, 32, 10, 1 / 800
  sampler = sampling.PoissonSampler(n, batch, seed=0)
  ledger, plan = plan_lib.plan_privacy(
      sampler, saved_meta=None, steps=steps, batch_size=batch, sampling_method="poisson",
      clip_norm=0.1, delta=plan_lib.resolve_delta("1/n", n), target_epsilon=3.0,
      noise_multiplier=None, accountant="rdp", seed=0,
      clip_norms={"lm": 0.1, "disc": 0.1})
  ledger.record_dp_steps(steps, noise_multipliers=plan_lib.plan_multipliers(plan))
  sigma, q = plan.noise_multiplier, batch / n

  def direct(releases):
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma)] * releases)),
        steps)
    return rdp.RdpAccountant(orders=accounting.RDP_ORDERS).compose(event).get_epsilon(delta)

  return ledger, plan, delta, direct(1), direct(2)


def test_two_release_plan_keeps_delta_and_both_clip_norms(two_release_plan):
  _, plan, delta, _, _ = two_release_plan
  assert plan.delta == delta
  assert plan.guarantee()["clip_norms"] == {"lm": 0.1, "disc": 0.1}


def test_both_releases_are_counted_in_epsilon(two_release_plan):
  """The ledger's ε equals dp-accounting's for the composed mechanism."""
  ledger, _, _, _, two = two_release_plan
  assert ledger.epsilon_spent() == pytest.approx(two, rel=1e-9)


def test_two_release_sigma_spends_the_target_within_1pc(two_release_plan):
  ledger, _, _, _, _ = two_release_plan
  assert 0.99 * 3.0 <= ledger.epsilon_spent() <= 3.0


def test_two_releases_cost_more_than_one_at_the_same_sigma(two_release_plan):
  _, _, _, one, two = two_release_plan
  assert one < 0.8 * two


@pytest.fixture(scope="module")
def single_loss_plan():
  sampler = sampling.PoissonSampler(800, 32, seed=0)
  _, plan = plan_lib.plan_privacy(
      sampler, saved_meta=None, steps=10, batch_size=32, sampling_method="poisson",
      clip_norm=0.1, delta=plan_lib.resolve_delta(None, 800), target_epsilon=3.0,
      noise_multiplier=1.5, accountant="rdp", seed=0)
  return plan


def test_single_loss_plan_delta_defaults_to_1_over_2n(single_loss_plan):
  assert single_loss_plan.delta == 1 / 1600


def test_single_loss_plan_saves_no_clip_norms_field(single_loss_plan):
  """Old checkpoints stay compatible."""
  assert "clip_norms" not in single_loss_plan.guarantee()


def test_single_loss_plan_has_one_release_per_step(single_loss_plan):
  assert plan_lib.plan_multipliers(single_loss_plan) == (1.5,)


build_step = functools.partial(
    step_lib.build_dp_step, optimizer="adam", learning_rate=1e-3,
    noise_multiplier=1.0, normalizer=1.0, seed=0, clip_norm=0.1)


def test_lm_with_head_has_two_named_losses_and_example_rng():
  multi = trainable.trainable(_config(), LENGTHS)
  assert multi.loss_names == ("lm", "disc") and multi.example_rng


def test_head_only_model_has_the_disc_loss_only():
  head = trainable.trainable(_config(head_only=True), LENGTHS)
  assert head.loss_names == ("disc",)


def test_per_loss_clip_norms_override_the_default():
  multi = trainable.trainable(_config(), LENGTHS)
  assert multi_loss.release_bounds(multi, 0.1, {"disc": 0.5}) == {
      "lm": 0.1, "disc": 0.5}


def test_ghost_clipping_of_several_losses_is_a_usage_error():
  with pytest.raises(errors.UsageError, match="ghost"):
    build_step(trainable.trainable(_config(), LENGTHS),
               clipping_method="ghost")


def test_clip_norm_of_an_unknown_loss_names_the_losses():
  with pytest.raises(errors.UsageError, match="'lm', 'disc'"):
    build_step(trainable.trainable(_config(), LENGTHS),
               clip_norms={"dsic": 0.1})


def test_per_loss_clip_norms_for_a_single_loss_model_are_refused():
  single = trainable.trainable(_config().lm, LENGTHS)
  with pytest.raises(errors.UsageError, match="has one"):
    build_step(single, clip_norms={"lm": 0.1})


def test_misspelt_delta_is_a_usage_error_naming_1_over_n():
  with pytest.raises(errors.UsageError, match="1/n"):
    plan_lib.resolve_delta("1/N", 800)
