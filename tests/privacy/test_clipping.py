"""Clipped gradient sums against an explicit per-example loop."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.privacy import clipping


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))[0]


MODEL = MLP()


def loss_fn(params, example):
  return (MODEL.apply(params, example["x"]) - example["y"]) ** 2


def make_problem(n=8, seed=0, scale=3.0):
  kp, kx, ky = jax.random.split(jax.random.PRNGKey(seed), 3)
  params = MODEL.init(kp, jnp.zeros(4))
  batch = {"x": scale * jax.random.normal(kx, (n, 4)),
           "y": scale * jax.random.normal(ky, (n,))}
  return params, batch


def group_of(path):
  return path[1].key  # {"params": {"Dense_0": ..., "Dense_1": ...}}


def reference(params, batch, mask, clip_norms, group=lambda path: "all"):
  """Python loop over examples: jax.grad, manual clipping, float64 sum."""
  leaves_with_path = jax.tree_util.tree_flatten_with_path(params)[0]
  total = [np.zeros(np.shape(leaf)) for _, leaf in leaves_with_path]
  norms, nonfinite, clipped = [], 0, 0
  for i in range(len(mask)):
    if not mask[i]:
      norms.append(0.0)
      continue
    example = jax.tree_util.tree_map(lambda x: x[i], batch)
    loss = float(loss_fn(params, example))
    grads = [np.asarray(g, np.float64) for g in
             jax.tree_util.tree_leaves(jax.grad(loss_fn)(params, example))]
    groups = [group(p) for p, _ in leaves_with_path]
    if not (math.isfinite(loss) and all(np.isfinite(g).all() for g in grads)):
      nonfinite += 1
      norms.append(0.0)
      continue
    group_sq = {}
    for g, name in zip(grads, groups):
      group_sq[name] = group_sq.get(name, 0.0) + float(np.sum(g ** 2))
    norms.append(math.sqrt(sum(group_sq.values())))
    clipped += any(math.sqrt(v) > clip_norms[k] for k, v in group_sq.items())
    for j, (g, name) in enumerate(zip(grads, groups)):
      total[j] += g * min(1.0, clip_norms[name] / math.sqrt(group_sq[name]))
  return total, np.array(norms), nonfinite, clipped


def assert_matches_reference(fn, params, batch, mask, clip_norms, group):
  grad_sum, stats = jax.jit(fn)(params, batch, jnp.asarray(mask))
  want, norms, nonfinite, clipped = reference(params, batch, mask, clip_norms,
                                              group)
  got = jax.tree_util.tree_leaves(grad_sum)
  assert all(g.dtype == jnp.float32 for g in got)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(stats.norms, norms, rtol=1e-5, atol=1e-6)
  assert int(stats.num_nonfinite) == nonfinite
  assert int(stats.num_clipped) == clipped
  assert int(stats.num_examples) == int(np.sum(mask))
  assert clipped > 0  # The test exercises clipping.


@pytest.mark.parametrize("microbatch_size", [None, 2, 4])
def test_flat_clipping_matches_loop_with_garbage_padding(microbatch_size):
  params, batch = make_problem()
  mask = np.array([1, 1, 0, 1, 1, 0, 1, 1], np.float32)
  # Padding rows hold NaN and huge values: they must not reach the sum.
  batch["x"] = batch["x"].at[2].set(jnp.nan).at[5].set(1e30)
  fn = clipping.clipped_grad(loss_fn, clip_norm=1.0,
                             microbatch_size=microbatch_size)
  assert fn.sensitivity == 1.0
  assert_matches_reference(fn, params, batch, mask, {"all": 1.0},
                           lambda path: "all")


@pytest.mark.parametrize("microbatch_size", [None, 4])
def test_per_group_clipping_matches_loop(microbatch_size):
  params, batch = make_problem()
  mask = np.array([1, 1, 1, 0, 1, 1, 1, 0], np.float32)
  batch["y"] = batch["y"].at[3].set(jnp.inf)
  clip_norms = {"Dense_0": 0.5, "Dense_1": 0.3}
  fn = clipping.per_group_clipped_grad(
      loss_fn, clip_norms=clip_norms, group_of=group_of,
      microbatch_size=microbatch_size)
  assert fn.sensitivity == pytest.approx(math.sqrt(0.5 ** 2 + 0.3 ** 2))
  assert_matches_reference(fn, params, batch, mask, clip_norms, group_of)


def linear_loss(params, example):
  return (jnp.dot(params["w"], example["x"]) + params["b"] - example["y"]) ** 2


def tree_norm(tree):
  return float(jnp.sqrt(sum(jnp.sum(x ** 2)
                            for x in jax.tree_util.tree_leaves(tree))))


N_ADV, CLIP_ADV = 6, 2.0


@pytest.fixture(scope="module")
def adversarial():
  """Six examples at clip norm 2: 0 and 1 with gradient norms of 1e6 and
  more, 4 with a NaN target. Returns the jitted clipped sum, its
  sensitivity, the params and the batch."""
  params = {"w": jnp.full(3, 0.1), "b": jnp.zeros(())}
  x = np.ones((N_ADV, 3), np.float32)
  y = np.zeros(N_ADV, np.float32)
  x[0], y[1] = 1e3, 1e6  # Gradient norms of 1e6 and more.
  y[4] = np.nan
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
  clip_fn = clipping.clipped_grad(linear_loss, clip_norm=CLIP_ADV)
  fn = jax.jit(clip_fn)
  return (lambda mask: fn(params, batch, mask)), clip_fn.sensitivity


@pytest.fixture(scope="module")
def adversarial_sum(adversarial):
  fn, _ = adversarial
  return fn(jnp.ones(N_ADV))


def test_adversarial_sum_is_finite(adversarial_sum):
  total, _ = adversarial_sum
  assert all(bool(jnp.isfinite(x).all())
             for x in jax.tree_util.tree_leaves(total))


def test_adversarial_sum_is_bounded_by_n_clip_norms(adversarial_sum):
  total, _ = adversarial_sum
  assert tree_norm(total) <= N_ADV * CLIP_ADV * (1 + 1e-6)


def test_adversarial_nan_is_counted_as_nonfinite(adversarial_sum):
  _, stats = adversarial_sum
  assert int(stats.num_nonfinite) == 1


def test_adversarial_huge_gradients_are_counted_as_clipped(adversarial_sum):
  _, stats = adversarial_sum
  assert int(stats.num_clipped) == 2
  assert float(stats.norms[0]) > 1e5 and float(stats.norms[1]) > 1e5


def test_adversarial_nan_example_reports_zero_norm_and_loss(adversarial_sum):
  _, stats = adversarial_sum
  assert float(stats.norms[4]) == 0.0 and float(stats.losses[4]) == 0.0


@pytest.mark.parametrize("i", range(N_ADV))
def test_each_examples_own_contribution_is_bounded(adversarial, i):
  fn, _ = adversarial
  single, _ = fn(jnp.zeros(N_ADV).at[i].set(1.0))
  assert tree_norm(single) <= CLIP_ADV * (1 + 1e-6)


@pytest.mark.parametrize("i", [0, 1])
def test_a_huge_gradient_contributes_exactly_the_clip_norm(adversarial, i):
  fn, _ = adversarial
  single, _ = fn(jnp.zeros(N_ADV).at[i].set(1.0))
  assert tree_norm(single) == pytest.approx(CLIP_ADV, rel=1e-5)


def test_a_nan_example_contributes_nothing(adversarial):
  fn, _ = adversarial
  single, _ = fn(jnp.zeros(N_ADV).at[4].set(1.0))
  assert tree_norm(single) == 0.0


def test_removing_one_example_moves_the_sum_by_at_most_the_sensitivity(
    adversarial, adversarial_sum):
  fn, sensitivity = adversarial
  total, _ = adversarial_sum
  without0, _ = fn(jnp.ones(N_ADV).at[0].set(0.0))
  diff = jax.tree_util.tree_map(jnp.subtract, total, without0)
  assert tree_norm(diff) <= sensitivity * (1 + 1e-5)


def test_accumulated_microbatches_equal_one_large_batch():
  params, batch = make_problem(n=12)
  mask = jnp.ones(12).at[7].set(0.0)
  fn = jax.jit(clipping.clipped_grad(loss_fn, clip_norm=0.5))
  big, big_stats = fn(params, batch, mask)
  scanned, scanned_stats = clipping.clipped_grad(
      loss_fn, clip_norm=0.5, microbatch_size=3)(params, batch, mask)
  # K separate calls, summed by the caller.
  parts = [fn(params, jax.tree_util.tree_map(lambda x: x[k:k + 3], batch),
              mask[k:k + 3])[0] for k in range(0, 12, 3)]
  summed = jax.tree_util.tree_map(lambda *xs: sum(xs), *parts)
  for a, b, c in zip(*map(jax.tree_util.tree_leaves, (big, scanned, summed))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
  for a, b in zip(big_stats, scanned_stats):
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_low_precision_params_accumulate_in_float32():
  params, batch = make_problem()
  params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
  batch = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), batch)
  grad_sum, _ = clipping.clipped_grad(loss_fn, clip_norm=1.0)(
      params, batch, jnp.ones(8))
  assert {g.dtype for g in jax.tree_util.tree_leaves(grad_sum)} == {
      jnp.dtype(jnp.float32)}


def test_microbatch_size_must_divide_batch():
  params, batch = make_problem(n=8)
  fn = clipping.clipped_grad(loss_fn, clip_norm=1.0, microbatch_size=3)
  with pytest.raises(ValueError, match="divide"):
    fn(params, batch, jnp.ones(8))


def test_unknown_group_names_the_parameter():
  params, batch = make_problem()
  fn = clipping.per_group_clipped_grad(
      loss_fn, clip_norms={"Dense_0": 1.0}, group_of=group_of)
  with pytest.raises(ValueError, match=r"\['Dense_1'\]\['bias'\]"):
    fn(params, batch, jnp.ones(8))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_invalid_clip_norm(bad):
  with pytest.raises(ValueError):
    clipping.clipped_grad(loss_fn, clip_norm=bad)
  with pytest.raises(ValueError):
    clipping.per_group_clipped_grad(loss_fn, clip_norms={"a": bad},
                                    group_of=lambda p: "a")
