"""Length-grouped batches for non-private (ε = ∞) training: less padding.

Every row of a split is padded to TASK_FEATURE_LENGTHS, and a step costs the
padded length whatever the row holds: the semantic parser's utterances fill
12 of their 48 input positions on average and its parses 75 of 176. Two
pieces cut that waste for a run with `train.sampling_method =
'length_grouped'`:

* `LengthGroupedSampler`: each epoch's random permutation is cut into
  windows of `window` batches; each window is sorted by length and cut into
  batches, and the epoch's batches are shuffled. A batch then holds examples
  of like length (as Hugging Face's `group_by_length`).
* `Trimmer`: a batch's token axes are cut to the smallest of a few bucket
  widths that holds its longest row (`bucket_widths`), so a run compiles its
  step for a handful of shapes, not one per batch.

Exactness: a trimmed position is past every row's last real token, where the
loss weight is 0 and no real position attends (padding is masked; causal
decoders never look ahead; T5's relative and GPT-2's absolute positions
count from the start). Each example's loss, a mean over its real target
tokens (`losses.per_example_loss`), is the same with or without the trim.

Formal guarantees: NONE. Which examples share a batch depends on their
lengths, so changing one example can move others between batches, and no
batch sum has a sensitivity bound. The plan refuses this sampler with a
finite TARGET_EPSILON, and its scheme (`sampling.NonPrivateScheme`) records
every step as a non-private release: the ledger says ε = ∞ whatever σ is.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from dpjax.privacy import sampling

METHOD = "length_grouped"
GROUP_STREAM = 0x6C656E67  # "leng"

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


class LengthGroupedSampler(sampling.ShuffleSampler):
  """`ShuffleSampler`'s fixed-size batches, each of examples of like length.

  Epoch `e` permutes the examples with
  `np.random.default_rng([seed, e, GROUP_STREAM])`, keeps the first
  `steps_per_epoch * batch_size` (the rest wait for another epoch, as in
  `ShuffleSampler`), sorts each window of `window * batch_size` of them by
  `lengths` (longest first, ties in permutation order), cuts batches and
  shuffles their order. Each example is in at most one batch per epoch. A
  larger window packs lengths tighter; a smaller one keeps batches more
  random from epoch to epoch.
  """

  def __init__(self, lengths: np.ndarray, batch_size: int, *, seed: int,
               window: int = 16):
    lengths = np.asarray(lengths)
    super().__init__(len(lengths), batch_size, seed=seed)
    if window < 1:
      raise ValueError(f"window must be >= 1 batches, got {window}.")
    self.lengths = lengths
    self.window = int(window)
    self._epoch_batches = (None, None)  # (epoch, [steps_per_epoch, B])

  def _batches(self, epoch: int) -> np.ndarray:
    if self._epoch_batches[0] != epoch:
      rng = np.random.default_rng([self.seed, epoch, GROUP_STREAM])
      used = self.steps_per_epoch * self.batch_size
      perm = rng.permutation(self.dataset_size)[:used]
      size = self.window * self.batch_size
      windows = [perm[s:s + size] for s in range(0, used, size)]
      ordered = np.concatenate([
          w[np.argsort(-self.lengths[w], kind="stable")] for w in windows])
      batches = ordered.reshape(self.steps_per_epoch, self.batch_size)
      self._epoch_batches = (epoch, batches[rng.permutation(len(batches))])
    return self._epoch_batches[1]

  def indices(self, step: int) -> np.ndarray:
    """Exactly `batch_size` int64 indices for `step`."""
    epoch, position = divmod(step, self.steps_per_epoch)
    return self._batches(epoch)[position].astype(np.int64)

  @property
  def scheme(self) -> sampling.NonPrivateScheme:
    return sampling.NonPrivateScheme()

  def describe(self) -> dict:
    return {
        "method": METHOD,
        "dataset_size": self.dataset_size,
        "batch_size": self.batch_size,
        "steps_per_epoch": self.steps_per_epoch,
        "window": self.window,
        "adjacency": self.scheme.neighbouring.value,
        "accounting": (
            "none: batches group examples by length, so one example can "
            "move others between batches; every step is recorded as a "
            "non-private release (ε = ∞)"),
    }


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


def _real_lengths(marks: np.ndarray) -> np.ndarray:
  """[N] one past each row's last nonzero entry (0 for an empty row)."""
  nonzero = marks != 0
  last = marks.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
  return np.where(nonzero.any(axis=1), last, 0)


class Trimmer:
  """Cuts a batch's token axes to the bucket widths its rows need.

  `Trimmer(arrays, buckets)(idx)` is `arrays` with each token axis cut to the
  smallest of `bucket_widths(length, buckets)` that holds the longest real
  row among `idx` (views, no copy); other features are returned whole.
  """

  def __init__(self, arrays: Mapping[str, np.ndarray], buckets: int):
    axes = {k: _AXES[k] for k in arrays if k in _AXES}
    if not axes:
      raise ValueError(
          f"no token axes to trim among the features {sorted(arrays)}: "
          "length grouping needs encoder-decoder or decoder-only rows")
    self.arrays, self.axes = dict(arrays), axes
    self.lengths = {a: _real_lengths(arrays[_MARKS[a]])
                    for a in set(axes.values())}
    self.widths = {a: np.asarray(bucket_widths(arrays[_MARKS[a]].shape[1],
                                               buckets))
                   for a in self.lengths}

  def __call__(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    widths = {}
    for axis, lengths in self.lengths.items():
      longest = int(lengths[np.asarray(idx).ravel()].max(initial=1))
      ladder = self.widths[axis]
      widths[axis] = int(ladder[np.searchsorted(ladder, longest)])
    return {k: v[:, :widths[self.axes[k]]] if k in self.axes else v
            for k, v in self.arrays.items()}
