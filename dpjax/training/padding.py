"""Less padding per step: each microbatch cut to the widths its rows need.

Every row of a split is padded to TASK_FEATURE_LENGTHS, and a step costs the
padded length whatever the rows hold: the semantic parser's utterances fill
12 of their 48 input positions on average and its parses 75 of 176. With
`train.trim_padding = True` a DP step's sample is ordered by length, packed
into microbatches (so short examples share one), and each microbatch is one
`accumulate` call whose token axes are cut to the smallest of a few bucket
widths that holds its rows (`bucket_widths`): a run compiles its step for a
handful of shapes, not one per batch.

Exactness: a cut position is past every row's last real token, where the
loss weight is 0 and no real position attends (padding is masked; causal
decoders never look ahead; T5's relative and GPT-2's absolute positions
count from the start). Each example's loss, a mean over its real target
tokens (`losses.per_example_loss`), is the same with or without the cut.

Formal guarantees: the sampler, and so the set of examples of each step, is
untouched; what changes is the order in which a step's sampled examples are
computed and how much padding is computed with them. Each example's clipped
gradient depends on that example alone (`privacy.clipping`), so the clipped
sum that is noised is the same sum taken in another order (float rounding
aside), and the accountant's model of the sampling still holds. As with any
length-dependent computation, a trimmed step's duration depends on its
examples' lengths: a guarantee about the released model says nothing about
timings.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

# Each token axis of the model features, and the feature whose nonzero
# entries mark a row's real positions on it.
_AXES = {
    "encoder_input_tokens": "encoder", "encoder_segment_ids": "encoder",
    "encoder_positions": "encoder",
    "decoder_input_tokens": "decoder", "decoder_target_tokens": "decoder",
    "decoder_loss_weights": "decoder", "decoder_segment_ids": "decoder",
    "decoder_positions": "decoder",
    "tokens": "sequence", "loss_weights": "sequence",
    "attention_mask": "sequence",
}
_MARKS = {"encoder": "encoder_input_tokens",
          "decoder": "decoder_target_tokens", "sequence": "attention_mask"}


def bucket_widths(length: int, buckets: int) -> tuple[int, ...]:
  """`buckets` widths up to `length`, evenly spaced, each rounded up to a
  multiple of 8 (friendlier tiles on accelerators), ending at `length`.

  >>> bucket_widths(176, 4)
  (48, 88, 136, 176)
  """
  if buckets < 1:
    raise ValueError(f"buckets must be >= 1, got {buckets}.")
  return tuple(sorted({min(length, 8 * math.ceil(length * j / buckets / 8))
                       for j in range(1, buckets + 1)}))


def real_lengths(marks: np.ndarray) -> np.ndarray:
  """[N] one past each row's last nonzero entry (0 for an empty row)."""
  nonzero = marks != 0
  last = marks.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
  return np.where(nonzero.any(axis=1), last, 0)


def by_length(idx: np.ndarray, mask: np.ndarray, lengths: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
  """`(idx, mask)` of a step's `[K, m]` microbatches with the real rows
  (mask > 0, with their weights) ordered longest first by `lengths`, and the
  padding rows after them: the same examples and weights, so that each
  microbatch holds examples of like length."""
  flat_idx, flat_mask = idx.ravel(), mask.ravel()
  real = np.flatnonzero(flat_mask > 0)
  order = real[np.argsort(-lengths[flat_idx[real]], kind="stable")]
  rest = np.flatnonzero(flat_mask <= 0)
  take = np.concatenate([order, rest])
  return flat_idx[take].reshape(idx.shape), flat_mask[take].reshape(mask.shape)


class Trimmer:
  """Cuts a microbatch's token axes to the bucket widths its rows need.

  `Trimmer(arrays, buckets)(rows)` is `arrays` with each token axis cut to
  the smallest of `bucket_widths(length, buckets)` that holds the longest
  real row among `rows` (views, no copy); other features are returned
  whole.
  """

  def __init__(self, arrays: Mapping[str, np.ndarray], buckets: int):
    axes = {k: _AXES[k] for k in arrays if k in _AXES}
    if not axes:
      raise ValueError(
          f"no token axes to trim among the features {sorted(arrays)}: "
          "trimming needs encoder-decoder or decoder-only rows")
    self.arrays, self.axes = dict(arrays), axes
    self.lengths = {a: real_lengths(arrays[_MARKS[a]])
                    for a in set(axes.values())}
    self.widths = {a: np.asarray(bucket_widths(arrays[_MARKS[a]].shape[1],
                                               buckets))
                   for a in self.lengths}

  def __call__(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    widths = {}
    for axis, lengths in self.lengths.items():
      longest = int(lengths[np.asarray(rows).ravel()].max(initial=1))
      ladder = self.widths[axis]
      widths[axis] = int(ladder[np.searchsorted(ladder, longest)])
    return {k: v[:, :widths[self.axes[k]]] if k in self.axes else v
            for k, v in self.arrays.items()}
