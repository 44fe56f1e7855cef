"""Gaussian noise, `privatize`, and the DP optimizers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.privacy import noise
from dpjax.privacy import optimizers


def test_noise_key_is_deterministic_and_step_dependent():
  k = noise.noise_key(7, 3)
  expected = jax.random.fold_in(
      jax.random.fold_in(jax.random.PRNGKey(7), noise.NOISE_STREAM_CONSTANT), 3)
  np.testing.assert_array_equal(k, expected)
  np.testing.assert_array_equal(k, noise.noise_key(7, jnp.int32(3)))
  assert not np.array_equal(k, noise.noise_key(7, 4))
  assert not np.array_equal(k, noise.noise_key(8, 3))


def test_gaussian_noise_statistics():
  stddev = 2.5
  tree = {"a": jnp.zeros((300, 400)), "b": jnp.zeros((300, 400))}
  out = noise.add_gaussian_noise(tree, jax.random.PRNGKey(0), stddev)
  a, b = np.asarray(out["a"]).ravel(), np.asarray(out["b"]).ravel()
  # 120k draws per leaf: sample std within ~0.2% (1 sigma) of stddev.
  assert np.std(a) == pytest.approx(stddev, rel=0.01)
  assert np.std(b) == pytest.approx(stddev, rel=0.01)
  assert abs(np.mean(a)) < 5 * stddev / np.sqrt(a.size)
  assert abs(np.corrcoef(a, b)[0, 1]) < 0.02  # Leaves get independent keys.
  again = noise.add_gaussian_noise(tree, jax.random.PRNGKey(0), stddev)
  np.testing.assert_array_equal(out["a"], again["a"])


def test_gaussian_noise_is_float32_and_zero_stddev_is_identity():
  tree = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)}
  out = noise.add_gaussian_noise(tree, jax.random.PRNGKey(1), 0.0)
  assert out["w"].dtype == jnp.float32
  np.testing.assert_array_equal(out["w"], tree["w"].astype(jnp.float32))


def test_privatize_adds_calibrated_noise_and_normalizes():
  sigma, sens, normalizer, seed = 1.3, 0.5, 64.0, 11
  tx = noise.privatize(noise_multiplier=sigma, sensitivity=sens,
                       normalizer=normalizer, seed=seed)
  grad_sum = {"w": jnp.linspace(-3, 3, 200_000).reshape(400, 500)}
  state = tx.init(grad_sum)
  update = jax.jit(tx.update)
  out0, state = update(grad_sum, state)
  out1, state = update(grad_sum, state)
  assert int(state.count) == 2
  residual = np.asarray(out0["w"]) * normalizer - np.asarray(grad_sum["w"])
  assert np.std(residual) == pytest.approx(sigma * sens, rel=0.01)
  for step, out in enumerate([out0, out1]):  # Noise keyed by (seed, count).
    want = noise.add_gaussian_noise(grad_sum, noise.noise_key(seed, step),
                                    sigma * sens)["w"] / normalizer
    np.testing.assert_allclose(out["w"], want, rtol=1e-6, atol=1e-7)
  assert not np.allclose(out0["w"], out1["w"])


def test_privatize_without_noise_is_exact_mean():
  tx = noise.privatize(noise_multiplier=0.0, sensitivity=1.0, normalizer=8.0,
                       seed=0)
  grad_sum = {"w": jax.random.normal(jax.random.PRNGKey(2), (5, 7))}
  out, _ = jax.jit(tx.update)(grad_sum, tx.init(grad_sum))
  np.testing.assert_array_equal(out["w"], grad_sum["w"] / 8.0)


@pytest.mark.parametrize("kwargs", [
    dict(noise_multiplier=-1.0), dict(sensitivity=0.0), dict(normalizer=0.0)])
def test_privatize_rejects_bad_arguments(kwargs):
  args = dict(noise_multiplier=1.0, sensitivity=1.0, normalizer=1.0, seed=0)
  with pytest.raises(ValueError):
    noise.privatize(**(args | kwargs))


DP = dict(noise_multiplier=0.8, sensitivity=1.5, normalizer=16.0, seed=5)
SCHEDULE = optax.linear_schedule(0.1, 0.01, 10)


@pytest.mark.parametrize("make_dp,base", [
    (lambda: optimizers.dp_sgd(0.1, **DP), optax.sgd(0.1)),
    (lambda: optimizers.dp_sgd(SCHEDULE, momentum=0.9, **DP),
     optax.sgd(SCHEDULE, momentum=0.9)),
    (lambda: optimizers.dp_adam(1e-3, b1=0.8, **DP), optax.adam(1e-3, b1=0.8)),
    (lambda: optimizers.dp_adamw(SCHEDULE, weight_decay=0.1, **DP),
     optax.adamw(SCHEDULE, weight_decay=0.1)),
    (lambda: optimizers.dp_adafactor(1e-2, min_dim_size_to_factor=2, **DP),
     optax.adafactor(1e-2, min_dim_size_to_factor=2)),
])
def test_dp_optimizer_equals_manual_noise_scale_base(make_dp, base):
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  grad_sums = [jax.tree_util.tree_map(lambda p, i=i: (i + 1.0) * p + 0.5,
                                      params) for i in range(2)]
  tx = make_dp()
  state, base_state = tx.init(params), base.init(params)
  for step, grad_sum in enumerate(grad_sums):
    got, state = tx.update(grad_sum, state, params)
    noisy = noise.add_gaussian_noise(
        grad_sum, noise.noise_key(DP["seed"], step),
        DP["noise_multiplier"] * DP["sensitivity"])
    scaled = jax.tree_util.tree_map(lambda x: x / DP["normalizer"], noisy)
    want, base_state = base.update(scaled, base_state, params)
    for g, w in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    params = optax.apply_updates(params, got)
