"""Span corruption against an explicit token-by-token construction, and the
mask against T5's stated rules (counts, runs, kept first, uniform cuts)."""
import itertools

import numpy as np
import pytest

from dpjax.data import span_corruption as sc


def _explicit(tokens, mask, vocab_size):
  """The objective spelled out one token at a time."""
  inputs, targets, run = [], [], -1
  for i, (t, m) in enumerate(zip(tokens, mask)):
    if m and (i == 0 or not mask[i - 1]):
      run += 1
      inputs.append(vocab_size - 1 - run)
      targets.append(vocab_size - 1 - run)
    if m:
      targets.append(t)
    else:
      inputs.append(t)
  return inputs, targets


def _runs(mask):
  return [(k, len(list(g))) for k, g in itertools.groupby(mask.tolist())]


@pytest.mark.parametrize("length", [2, 3, 7, 20, 128, 301])
def test_corrupt_equals_the_explicit_construction(length):
  rng = np.random.default_rng(length)
  for _ in range(20):
    tokens = rng.integers(0, 500, length)
    mask = sc.noise_mask(length, 0.15, 3.0, rng)
    inputs, targets = sc.corrupt(tokens, mask, 600)
    want_inputs, want_targets = _explicit(tokens, mask, 600)
    assert inputs.tolist() == want_inputs
    assert targets.tolist() == want_targets


def test_corrupt_on_hand_example():
  inputs, targets = sc.corrupt(np.arange(10, 17),
                               np.array([0, 1, 1, 0, 0, 1, 0], bool), 100)
  assert inputs.tolist() == [10, 99, 13, 14, 98, 16]
  assert targets.tolist() == [99, 11, 12, 98, 15]


@pytest.mark.parametrize("length,density,span", [
    (2, 0.15, 3.0), (10, 0.15, 3.0), (114, 0.15, 3.0), (128, 0.5, 2.0),
    (500, 0.15, 3.0), (40, 0.3, 1.0)])
def test_mask_follows_t5s_rules(length, density, span):
  rng = np.random.default_rng(0)
  num_noise = min(max(round(length * density), 1), length - 1)
  num_spans = max(1, round(num_noise / span))
  for _ in range(50):
    mask = sc.noise_mask(length, density, span, rng)
    runs = _runs(mask)
    assert mask.shape == (length,) and mask.sum() == num_noise
    assert runs[0][0] is False  # kept first
    assert sum(1 for noisy, _ in runs if noisy) == min(num_spans, num_noise,
                                                       length - num_noise)


def test_run_lengths_are_uniform_compositions():
  """6 noise tokens in 2 runs of 10 kept + 6 noise: the first noise run's
  length is uniform on 1..5 (every composition equally likely)."""
  rng = np.random.default_rng(1)
  counts = np.zeros(6)
  trials = 6000
  for _ in range(trials):
    mask = sc.noise_mask(16, 6 / 16, 3.0, rng)
    first_noise = next(n for noisy, n in _runs(mask) if noisy)
    counts[first_noise] += 1
  freq = counts[1:] / trials
  assert np.all(np.abs(freq - 0.2) < 4 * np.sqrt(0.2 * 0.8 / trials))


def test_a_segment_of_one_token_is_refused():
  with pytest.raises(ValueError, match=">= 2 tokens"):
    sc.noise_mask(1, 0.15, 3.0, np.random.default_rng(0))
