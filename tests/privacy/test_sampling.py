"""Poisson and shuffle samplers."""

import math

import numpy as np
import pytest
from scipy import stats

from dpjax.privacy import sampling


def poisson_forward():
  """Ten steps' samples of a Poisson sampler (seed 3), in order."""
  a = sampling.PoissonSampler(5000, 50, seed=3)
  return [a.indices(s) for s in range(10)]


def test_poisson_is_deterministic_and_resumable():
  """The same seed, whatever the order of the steps (and an expected batch
  size or the rate), gives the same samples."""
  b = sampling.PoissonSampler(5000, sampling_rate=0.01, seed=3)
  backward = [b.indices(s) for s in reversed(range(10))][::-1]
  for x, y in zip(poisson_forward(), backward):
    np.testing.assert_array_equal(x, y)


def test_poisson_steps_draw_different_samples():
  forward = poisson_forward()
  assert not np.array_equal(forward[0], forward[1])


def test_poisson_seeds_draw_different_samples():
  other = sampling.PoissonSampler(5000, 50, seed=4)
  assert not np.array_equal(poisson_forward()[0], other.indices(0))


def test_poisson_indices_are_int64():
  assert poisson_forward()[7].dtype == np.int64


def test_poisson_empirical_rate():
  n, q, steps = 2000, 0.05, 400
  sampler = sampling.PoissonSampler(n, sampling_rate=q, seed=0)
  counts = np.zeros(n)
  sizes = []
  for step in range(steps):
    idx = sampler.indices(step)
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < n
    counts[idx] += 1
    sizes.append(idx.size)
  # Mean batch size: std of the mean is sqrt(n q (1-q) / steps) ~ 0.49.
  assert np.mean(sizes) == pytest.approx(n * q, abs=2.5)
  # Per-example inclusion counts are Binomial(steps, q): check their spread.
  assert np.var(counts) == pytest.approx(steps * q * (1 - q), rel=0.15)
  assert sampler.steps_per_epoch() == pytest.approx(1 / q)


def test_default_max_batch_size_is_the_overflow_quantile():
  n, q, p = 10_000, 0.01, 1e-6
  m = sampling.PoissonSampler(n, sampling_rate=q, seed=0).max_batch_size
  assert stats.binom.sf(m, n, q) <= p < stats.binom.sf(m - 1, n, q)
  loose = sampling.PoissonSampler(n, sampling_rate=q, seed=0,
                                  overflow_probability=0.5).max_batch_size
  assert loose == pytest.approx(n * q, abs=1)


def test_poisson_microbatches_pad_with_mask():
  sampler = sampling.PoissonSampler(1000, 20, seed=1, max_batch_size=40)
  idx, mask = sampler.microbatches(0, 8)
  assert idx.shape == mask.shape == (5, 8)
  assert idx.dtype == np.int64 and mask.dtype == np.float32
  sample = sampler.indices(0)
  np.testing.assert_array_equal(idx[mask == 1], sample)
  assert np.all(idx[mask == 0] == 0)


def test_poisson_overflow_returns_more_microbatches_and_drops_nothing():
  sampler = sampling.PoissonSampler(1000, 100, seed=2, max_batch_size=10)
  for step in range(5):
    sample = sampler.indices(step)
    assert sample.size > 10
    idx, mask = sampler.microbatches(step, 4)
    assert idx.shape[1] == 4 and idx.shape[0] == math.ceil(sample.size / 4)
    assert idx.shape[0] > math.ceil(10 / 4)
    np.testing.assert_array_equal(idx[mask == 1], sample)


def test_poisson_describe():
  d = sampling.PoissonSampler(100, 10, seed=0, max_batch_size=30).describe()
  assert d["method"] == "poisson" and d["adjacency"] == "add_or_remove_one"
  assert d["sampling_rate"] == 0.1 and d["dataset_size"] == 100
  assert d["expected_batch_size"] == 10 and d["max_batch_size"] == 30
  assert "overflow_policy" in d


@pytest.mark.parametrize("kwargs", [
    dict(expected_batch_size=0), dict(sampling_rate=1.5),
    dict(expected_batch_size=10, sampling_rate=0.1), dict()])
def test_poisson_validation(kwargs):
  with pytest.raises(ValueError):
    sampling.PoissonSampler(100, seed=0, **kwargs)


def test_shuffle_covers_each_example_once_per_epoch():
  n, b = 100, 10
  sampler = sampling.ShuffleSampler(n, b, seed=9)
  assert sampler.steps_per_epoch == 10
  epochs = []
  for epoch in range(2):
    batches = [sampler.indices(epoch * 10 + s) for s in range(10)]
    assert all(x.size == b and x.dtype == np.int64 for x in batches)
    seen = np.concatenate(batches)
    np.testing.assert_array_equal(np.sort(seen), np.arange(n))
    epochs.append(seen)
  assert not np.array_equal(epochs[0], epochs[1])
  np.testing.assert_array_equal(  # Resumable: a fresh sampler agrees.
      sampling.ShuffleSampler(n, b, seed=9).indices(13), epochs[1][30:40])


SHUFFLE_105 = sampling.ShuffleSampler(105, 10, seed=0)


def test_shuffle_drops_remainder():
  assert SHUFFLE_105.steps_per_epoch == 10
  seen = np.concatenate([SHUFFLE_105.indices(s) for s in range(10)])
  assert np.unique(seen).size == 100


def test_shuffle_microbatches_are_full_and_hold_the_batch():
  idx, mask = SHUFFLE_105.microbatches(3, 5)
  assert idx.shape == (2, 5) and np.all(mask == 1)
  assert SHUFFLE_105.max_batch_size == mask.sum() == 10  # the trainer's shape
  np.testing.assert_array_equal(idx.ravel(), SHUFFLE_105.indices(3))


def test_shuffle_describe():
  d = SHUFFLE_105.describe()
  assert d["method"] == "shuffle" and d["adjacency"] == "replace_one"
  assert "sigma/2" in d["accounting"]


def test_shuffle_batch_larger_than_the_data_is_refused():
  with pytest.raises(ValueError):
    sampling.ShuffleSampler(10, 11, seed=0)
