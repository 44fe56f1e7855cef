"""Input canaries: training examples of random target tokens, each in the
run by a secret fair coin, scored by the final model's loss on them.

A canary is a copy of a real training row (chosen by the run's public
seed) whose target tokens, the ones its loss weights mark, are replaced by
tokens drawn uniformly from the split's target vocabulary (also public):
text the model can only predict by having trained on it. All m canaries are
appended to the training split; an excluded canary's loss weights are zero,
so its loss and gradient are zero and it is absent from every clipped sum.
The split's size, which the sampling rate and the normalizer use and the
ledger records, is n + m whatever the coins say.

The score of a canary is the negative loss of the final params on it
(`scores`): the black-box adversary of the final model, who sees no
intermediate release.

Formal guarantees
-----------------
Each canary is one training example of the run, sampled, clipped and
noised as every example is: the run's guarantee holds for it as for any
example (with a user-level mechanism each canary is a user of its own), and
that is what the audit tests (Steinke, Nasr and Jagielski, NeurIPS 2023,
arXiv 2305.08846). The coins come from the run's secret noise key
(`canaries.coins`, the gradient audit's draw); the rows are public.

Costs and limits: the run trains on m more rows (each a zero-loss row when
out); scoring is one forward pass over the m canaries. Rows of unpacked
encoder-decoder features (the decoder's inputs are its targets shifted
right, recomputed for the canary) and of decoder-only features are
modelled; packed rows and the dual encoder's groups of pairs are refused.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import numpy as np

from dpjax import errors
from dpjax.audit import canaries as canaries_lib

# The loss-weight and target features of the modelled row layouts.
_LAYOUTS = (
    ("decoder_loss_weights", "decoder_target_tokens"),  # encoder-decoder
    ("loss_weights", "tokens"),  # decoder-only
)
_SCORE_BATCH = 64


@dataclasses.dataclass(frozen=True, eq=False)
class InputCanaries:
  """m canary rows (`rows`: the split's features, [m, ...]) and the
  feature holding their loss weights."""
  rows: Mapping[str, np.ndarray]
  weights: str

  @property
  def count(self) -> int:
    return len(self.rows[self.weights])

  def added(self, noise_secret) -> dict[str, np.ndarray]:
    """The rows the run trains on: every canary, an excluded one (by its
    secret coin) with zero loss weights."""
    coins = np.asarray(canaries_lib.coins(noise_secret, self.count))
    rows = dict(self.rows)
    rows[self.weights] = np.where(coins[:, None], rows[self.weights], 0
                                  ).astype(rows[self.weights].dtype)
    return rows


def _layout(train: Mapping[str, np.ndarray]) -> tuple[str, str]:
  for weights, targets in _LAYOUTS:
    if weights in train and targets in train:
      if any(k.endswith("_segment_ids") for k in train):
        break
      return weights, targets
  raise errors.UsageError(
      "--kind=input models unpacked encoder-decoder rows and decoder-only "
      f"rows; this split's features are {sorted(train)}")


def choose(train: Mapping[str, np.ndarray], count: int,
           seed: int) -> InputCanaries:
  """`count` canaries made from rows of the split `train` (public `seed`)."""
  weights, targets = _layout(train)
  rng = np.random.default_rng([seed, canaries_lib.CANARY_STREAM])
  n = len(train[weights])
  source = rng.choice(n, size=count, replace=count > n)
  rows = {k: np.array(v[source]) for k, v in train.items()}
  marked = rows[weights] > 0
  vocabulary = np.unique(train[targets][train[weights] > 0])
  random = rng.choice(vocabulary, size=marked.shape)
  rows[targets] = np.where(marked, random, rows[targets]).astype(
      rows[targets].dtype)
  if "decoder_input_tokens" in rows:  # the targets shifted right
    shifted = np.zeros_like(rows[targets])
    shifted[:, 1:] = rows[targets][:, :-1]
    rows["decoder_input_tokens"] = shifted
  return InputCanaries(rows, weights)


def scores(batch_loss, params, canaries: InputCanaries) -> np.ndarray:
  """float64[m]: minus each canary's loss under `params` (its real
  weights), in batches of `_SCORE_BATCH` (the last one padded)."""
  loss = jax.jit(batch_loss)
  m = canaries.count
  padded = -(-m // _SCORE_BATCH) * _SCORE_BATCH
  rows = {k: np.concatenate([v, np.repeat(v[:1], padded - m, axis=0)])
          for k, v in canaries.rows.items()}
  out = [np.asarray(loss(params, {k: v[i:i + _SCORE_BATCH]
                                  for k, v in rows.items()}))
         for i in range(0, padded, _SCORE_BATCH)]
  return -np.concatenate(out)[:m].astype(np.float64)
