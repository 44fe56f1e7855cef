"""T5's span-corruption objective (Raffel et al. 2020, §3.1.4), in numpy.

A segment of tokens is split into alternating runs of kept and noise tokens;
the input keeps the kept runs and puts one sentinel in place of each noise
run, the target lists each sentinel followed by the run it hides:

    tokens   the  cat  sat  on   the  mat  .
    mask      .    x    x   .    .    x    .
    inputs   the  <0>  on  the  <1>  .
    targets  <0>  cat  sat <1>  mat

Sentinels are the vocabulary's last ids, `<extra_id_i> = vocab_size - 1 - i`,
as in T5's SentencePiece vocabulary with extra ids; EOS is appended by the
task (seqio's `add_eos`), not here.

The mask is T5's `random_spans_noise_mask`: round(n * density) noise tokens
(at least 1, at most n - 1) in round(noise / mean_span_length) runs (at
least 1), the kept and the noise tokens each cut into that many non-empty
runs uniformly at random, kept first. Every draw comes from the generator it
is given, so a corpus corrupted with one seed is the same on every machine.

This module is pure numpy (no TensorFlow): the pretraining task
(`tasks.pretraining`) calls it on each segment before tokens become tensors.
"""
from __future__ import annotations

import numpy as np


def _random_segmentation(num_items: int, num_segments: int,
                         rng: np.random.Generator) -> np.ndarray:
  """Lengths (>= 1 each, summing to `num_items`) of `num_segments` runs, every
  composition equally likely: the cut points are a uniform subset of the
  `num_items - 1` gaps."""
  cuts = np.sort(rng.choice(num_items - 1, num_segments - 1, replace=False)) + 1
  return np.diff(np.concatenate([[0], cuts, [num_items]]))


def noise_mask(length: int, noise_density: float, mean_span_length: float,
               rng: np.random.Generator) -> np.ndarray:
  """[length] bool, True on the noise tokens (see the module docstring)."""
  if length < 2:
    raise ValueError(f"a segment to corrupt needs >= 2 tokens, got {length}")
  num_noise = int(np.clip(round(length * noise_density), 1, length - 1))
  num_spans = max(1, int(round(num_noise / mean_span_length)))
  num_spans = min(num_spans, num_noise, length - num_noise)
  noise = _random_segmentation(num_noise, num_spans, rng)
  kept = _random_segmentation(length - num_noise, num_spans, rng)
  runs = np.stack([kept, noise], axis=1).reshape(-1)  # kept, noise, kept, ...
  return np.repeat(np.tile([False, True], num_spans), runs)


def corrupt(tokens: np.ndarray, mask: np.ndarray, vocab_size: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) of `tokens` with the noise runs of `mask` replaced by
  sentinels `vocab_size - 1 - i` (run i) in the inputs and listed after them
  in the targets."""
  tokens = np.asarray(tokens)
  starts = mask & ~np.concatenate([[False], mask[:-1]])  # a run's first token
  sentinels = vocab_size - np.cumsum(starts)  # run i: vocab_size - 1 - i
  inputs = np.where(starts, sentinels, tokens)[~mask | starts]
  # Targets: each noise token moves right by the number of sentinels before
  # it (one per run begun so far); each run's sentinel goes just before it.
  where = np.arange(int(mask.sum())) + np.cumsum(starts)[mask]
  targets = np.empty(where.size + int(starts.sum()), tokens.dtype)
  targets[where] = tokens[mask]
  targets[where[starts[mask]] - 1] = sentinels[starts]
  return inputs.astype(tokens.dtype), targets
