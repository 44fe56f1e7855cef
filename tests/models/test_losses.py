"""Tests of the losses and of the trainer-facing loss functions."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.models import losses, t5


@functools.lru_cache
def _batch_loss(cfg):
  return jax.jit(t5.make_batch_loss(cfg))


def _batch():
  return {
      "encoder_input_tokens": np.array([[5, 6, 7, 1, 0], [8, 9, 1, 0, 0], [3, 1, 0, 0, 0]],
                                       np.int32),
      "decoder_input_tokens": np.array([[0, 10, 11, 12], [0, 13, 0, 0], [0, 0, 0, 0]],
                                       np.int32),
      "decoder_target_tokens": np.array([[10, 11, 12, 1], [13, 1, 0, 0], [0, 0, 0, 0]],
                                        np.int32),
      "decoder_loss_weights": np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], np.int32),
  }


def test_per_example_loss_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
  targets = rng.integers(0, 11, (3, 5))
  weights = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], np.float32)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  xent = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(losses.token_cross_entropy(logits, targets), xent, rtol=1e-5)
  expected = (xent * weights).sum(-1) / np.maximum(weights.sum(-1), 1)
  got = losses.per_example_loss(logits, targets, weights)
  assert got.shape == (3,) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  assert float(got[2]) == 0.0  # no target tokens -> 0, not NaN


def test_cross_entropy_is_stable():
  logits = jnp.array([[[1e4, -1e4, 0.0]]], jnp.bfloat16)
  xent = losses.token_cross_entropy(logits, jnp.array([[1]]))
  assert xent.dtype == jnp.float32 and np.isfinite(xent).all()
  np.testing.assert_allclose(xent, 2e4, rtol=1e-2)


def test_masked_targets_do_not_change_loss(tiny):
  cfg, params, _ = tiny
  batch_loss = _batch_loss(cfg)
  batch = _batch()
  base = batch_loss(params, batch)
  changed = dict(batch)
  # Garbage targets at weight-0 positions; decoder inputs are untouched, so
  # the loss at weighted positions must not move.
  targets = batch["decoder_target_tokens"].copy()
  targets[batch["decoder_loss_weights"] == 0] = 42
  changed["decoder_target_tokens"] = targets
  np.testing.assert_allclose(batch_loss(params, changed), base, rtol=1e-6)
  # Decoder inputs after the last weighted position don't matter either (causal).
  dec = batch["decoder_input_tokens"].copy()
  dec[1, 2:] = 77
  changed["decoder_input_tokens"] = dec
  np.testing.assert_allclose(batch_loss(params, changed), base, rtol=1e-6)
  assert float(base[2]) == 0.0


def test_batch_loss_matches_manual(tiny, forward):
  cfg, params, _ = tiny
  batch = _batch()
  logits = forward(cfg, params, batch["encoder_input_tokens"], batch["decoder_input_tokens"])
  logits = np.asarray(logits, np.float64)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  xent = -np.take_along_axis(log_probs, batch["decoder_target_tokens"][..., None], -1)[..., 0]
  w = batch["decoder_loss_weights"]
  expected = (xent * w).sum(-1) / np.maximum(w.sum(-1), 1)
  np.testing.assert_allclose(_batch_loss(cfg)(params, batch), expected, rtol=1e-5)


def test_example_loss_matches_batch_loss(tiny):
  """Without 'dropout_rng' the per-example loss is the deterministic one."""
  cfg, params, _ = tiny
  batch = _batch()
  per_example = jax.jit(jax.vmap(t5.make_example_loss(cfg), in_axes=(None, 0)))
  np.testing.assert_allclose(per_example(params, batch), _batch_loss(cfg)(params, batch),
                             rtol=1e-5)


def test_example_loss_per_example_grads(tiny):
  """The DP trainer's pattern: vmap(value_and_grad(example_loss)), with dropout."""
  cfg, params, _ = tiny
  batch = _batch()
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    keys = jax.random.key_data(keys)  # the trainer passes raw uint32[2] keys
  batch["dropout_rng"] = keys
  per_example = jax.jit(jax.vmap(jax.value_and_grad(t5.make_example_loss(cfg)),
                                 in_axes=(None, 0)))
  values, grads = per_example(params, batch)
  assert values.shape == (3,) and np.isfinite(values).all()
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
    assert g.shape == (3,) + p.shape
  # The example with no target tokens has zero loss and zero gradient.
  assert float(values[2]) == 0.0
  assert all(float(jnp.abs(g[2]).max()) == 0.0 for g in jax.tree.leaves(grads))
  # Dropout is on (the loss differs from the eval loss) and determined by the key.
  eval_loss = _batch_loss(cfg)(params, {k: v for k, v in batch.items() if k != "dropout_rng"})
  assert not np.allclose(values[:2], eval_loss[:2], rtol=1e-4)
  values_again, _ = per_example(params, batch)
  np.testing.assert_array_equal(values, values_again)
  batch["dropout_rng"] = keys[::-1]
  assert not np.allclose(per_example(params, batch)[0][:2], values[:2], rtol=1e-4)


def test_cross_entropy_gradient_is_softmax_minus_one_hot_without_a_scatter():
  """The gradient is the textbook one, and it compiles without a scatter
  (the target's logit is selected, not gathered: a scatter runs as a loop
  on TPUs)."""
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 4, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 4))
  loss = lambda z: losses.token_cross_entropy(z, targets).sum()
  softmax = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  expected = softmax - np.eye(7, dtype=np.float32)[targets]
  np.testing.assert_allclose(jax.grad(loss)(logits), expected, rtol=1e-5,
                             atol=1e-6)
  hlo = jax.jit(jax.grad(loss)).lower(logits).as_text()
  assert "scatter" not in hlo and "gather" not in hlo
