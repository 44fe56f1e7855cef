"""Comparing two runs that should agree up to the order of float32 sums."""
import jax
import numpy as np


def update_differences(a, b, start) -> list[float]:
  """Per leaf, ||Δ_b - Δ_a|| / ||Δ_a||, Δ a run's update from `start` (the
  params both began from): how far two runs that should make the same
  update are apart, as a fraction of the update.

  Runs that differ only in the order of their float32 sums (another device
  layout, microbatching, trimmed padding) differ by rounding, which Adam's
  m / sqrt(v) can blow up at the few coordinates where a gradient nearly
  cancels, so elementwise tolerances fail there by chance; in norm those
  coordinates are a few millionths of the update, while a real slip (a
  wrong batch, noise draw or learning rate) moves the whole leaf."""
  f64 = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]
  return [np.linalg.norm(y - x) / np.linalg.norm(x - s)
          for x, y, s in zip(f64(a), f64(b), f64(start))]
