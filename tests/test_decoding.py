"""Tests of cached autoregressive generation (dpjax.generation.decoding)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.generation import decoding
from dpjax.models import t5

MAX_LEN = 7
ENC = np.array([[5, 6, 7, 8, 1, 0], [9, 10, 1, 0, 0, 0], [11, 12, 13, 14, 15, 1]], np.int32)


@pytest.fixture(scope="module")
def model():
  # The tiny model of tests/models (same config and seed: shares compilations).
  cfg = t5.T5Config(vocab_size=97, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                    num_encoder_layers=2, num_decoder_layers=2)
  params, _ = t5.init_params(cfg, jax.random.PRNGKey(0), input_length=8, target_length=8)
  return cfg, params


def _greedy_reference(cfg, params, enc, max_length, eos_id):
  """Greedy decoding by re-running the full (uncached) model every step."""
  forward = jax.jit(functools.partial(t5.T5Transformer(cfg).apply, {"params": params}))
  out = np.zeros((enc.shape[0], max_length), np.int32)
  dec = np.zeros((enc.shape[0], max_length), np.int32)  # start token 0, causal padding
  done = np.zeros(enc.shape[0], bool)
  for t in range(max_length):
    token = np.asarray(jnp.argmax(forward(enc, dec)[:, t], -1))
    token = np.where(done, 0, token)
    out[:, t] = token
    done |= token == eos_id
    if t + 1 < max_length:
      dec[:, t + 1] = token
  return out


def test_greedy_matches_uncached_loop(model):
  cfg, params = model
  got = decoding.generate(cfg, params, ENC, max_length=MAX_LEN, rng=None, greedy=True,
                          eos_id=-1)
  assert got.shape == (3, MAX_LEN) and got.dtype == jnp.int32
  ref = _greedy_reference(cfg, params, ENC, MAX_LEN, eos_id=-1)
  np.testing.assert_array_equal(got, ref)

  # Make a token that row 0 emits at step 2 the EOS: row 0 stops there and
  # is zero-padded afterwards, other rows stop at their own first occurrence.
  eos = int(ref[0, 2])
  got = decoding.generate(cfg, params, ENC, max_length=MAX_LEN, rng=None, greedy=True,
                          eos_id=eos)
  ref_eos = _greedy_reference(cfg, params, ENC, MAX_LEN, eos_id=eos)
  np.testing.assert_array_equal(got, ref_eos)
  first = int(np.argmax(ref[0] == eos))
  assert first <= 2 and got[0, first] == eos and np.all(got[0, first + 1:] == 0)


def test_top_k_1_equals_greedy(model):
  cfg, params = model
  greedy = decoding.generate(cfg, params, ENC, max_length=MAX_LEN, rng=None, greedy=True)
  sampled = decoding.generate(cfg, params, ENC, max_length=MAX_LEN,
                              rng=jax.random.PRNGKey(7), top_k=1, top_p=0.95, temperature=2.0)
  np.testing.assert_array_equal(sampled, greedy)


def test_sampling_is_seeded_and_valid(model):
  cfg, params = model
  kwargs = dict(max_length=MAX_LEN, top_k=20, top_p=0.9, temperature=1.5)
  a = decoding.generate(cfg, params, ENC, rng=jax.random.PRNGKey(1), **kwargs)
  b = decoding.generate(cfg, params, ENC, rng=jax.random.PRNGKey(1), **kwargs)
  c = decoding.generate(cfg, params, ENC, rng=jax.random.PRNGKey(2), **kwargs)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert a.shape == (3, MAX_LEN) and a.min() >= 0 and a.max() < cfg.vocab_size


def test_top_p_filter_keeps_smallest_nucleus():
  probs = np.array([[0.1, 0.5, 0.15, 0.25],
                    [0.1, 0.5, 0.15, 0.25],
                    [0.1, 0.5, 0.15, 0.25],
                    [0.97, 0.01, 0.01, 0.01]], np.float32)
  ps = [0.7, 0.45, 0.8, 0.5]
  expected = [[False, True, False, True],   # 0.5 + 0.25 >= 0.7
              [False, True, False, False],  # 0.5 alone >= 0.45
              [False, True, True, True],    # 0.75 < 0.8 needs the 0.15 too
              [True, False, False, False]]  # the top token alone
  for row, p, keep in zip(probs, ps, expected):
    out = decoding.top_p_filter(jnp.log(jnp.asarray(row))[None], p)[0]
    assert list(np.isfinite(out)) == keep, (row, p)
    np.testing.assert_allclose(out[np.array(keep)], np.log(row)[np.array(keep)], rtol=1e-6)
  # p tiny: still keeps one token; p = 1: keeps everything.
  assert np.isfinite(decoding.top_p_filter(jnp.log(jnp.asarray(probs[:1])), 1e-9)).sum() == 1
  assert np.isfinite(decoding.top_p_filter(jnp.log(jnp.asarray(probs[:1])), 1.0)).all()


def test_top_k_filter():
  logits = jnp.array([[0.1, 3.0, -1.0, 2.0, 2.0]])
  kept = lambda k: list(np.isfinite(decoding.top_k_filter(logits, k)[0]))
  assert kept(1) == [0, 1, 0, 0, 0]
  assert kept(2) == [0, 1, 0, 1, 0]  # exactly k, ties broken by index
  assert kept(3) == [0, 1, 0, 1, 1]
  assert kept(5) == [1, 1, 1, 1, 1]


def test_top_k_filter_matches_a_stable_sort():
  """Against the definition by a stable sort (numpy), on rows with many
  ties, -inf entries and signed zeros, for every k, traced or not."""
  rng = np.random.default_rng(0)
  logits = rng.integers(-4, 5, size=(6, 37)).astype(np.float32) * 0.5
  logits[1, ::3] = -np.inf
  logits[2] = rng.normal(size=37) * 1e3
  logits[3, :5] = [0.0, -0.0, 0.0, -0.0, 1e-30]
  traced = jax.jit(decoding.top_k_filter)
  for k in range(1, 40):
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    want = np.full_like(logits, -np.inf)
    np.put_along_axis(want, order, np.take_along_axis(logits, order, -1), -1)
    np.testing.assert_array_equal(decoding.top_k_filter(logits, k), want)
    np.testing.assert_array_equal(traced(logits, jnp.int32(k)), want)


def test_top_p_filter_matches_a_stable_sort():
  """Against the definition by a stable sort (float64 cumulative mass): the
  nucleus of each row for p between every two of its cumulative masses (so
  float32 rounding cannot decide), with ties, -inf entries and min_keep."""
  rng = np.random.default_rng(1)
  logits = rng.integers(-4, 5, size=(5, 29)).astype(np.float32) * 0.7
  logits[1, ::3] = -np.inf
  logits[2] = rng.normal(size=29) * 3
  logits[3, :6] = 2.0  # six tied leaders
  traced = jax.jit(decoding.top_p_filter, static_argnames="min_keep")
  for row in logits:
    order = np.argsort(-row, kind="stable")
    probs = np.exp(row[order].astype(np.float64) - row.max())
    cum = np.cumsum(probs / probs.sum())
    ends = np.unique(np.round(cum, 6))
    for i, p in enumerate((ends[:-1] + ends[1:]) / 2):
      for min_keep in (1, 3):
        kept = max(min_keep, int(np.sum(cum - probs / probs.sum() < p)))
        want = np.full_like(row, -np.inf)
        want[order[:kept]] = row[order[:kept]]
        got = traced(row[None], jnp.float32(p), min_keep=min_keep)
        if i == 3:  # and once untraced (each concrete p compiles anew)
          got = decoding.top_p_filter(row[None], p, min_keep)
        np.testing.assert_array_equal(got[0], want, err_msg=f"p={p}")


def test_generate_is_jittable(model):
  """generate traces under an outer jit (lowering only; compiling is slow)."""
  cfg, params = model
  fn = jax.jit(functools.partial(decoding.generate, cfg, max_length=MAX_LEN, top_k=5,
                                 top_p=0.9))
  lowered = fn.lower(params, ENC, rng=jax.random.PRNGKey(0))
  assert lowered.out_info.shape == (3, MAX_LEN)
