"""seqio task -> numpy arrays, for random-access (Poisson) sampling.

The DP trainer samples examples by index (Poisson sampling with rate
q = B / n), so the tokenized split is materialised once as numpy arrays of
model features and then indexed on the host.

This is the data layer: TensorFlow and seqio are imported here (and in the
top-level `tasks` package) and nowhere else. `dpjax.privacy`, `dpjax.models`
and the train step never import TensorFlow; they only see the numpy arrays
returned here.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's info chatter, not ours
import numpy as np  # noqa: E402
import seqio  # noqa: E402
import tensorflow as tf  # noqa: E402

ENC_DEC_FEATURES = (
    "encoder_input_tokens",
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
)
_BATCH = 1024


def _to_numpy(ds: tf.data.Dataset, keys) -> dict[str, np.ndarray]:
  """Concatenates `keys` of `ds` (fixed-shape examples) into numpy arrays."""
  ds = ds.map(lambda ex: {k: ex[k] for k in keys})
  chunks: dict[str, list[np.ndarray]] = {k: [] for k in keys}
  for batch in ds.batch(_BATCH).prefetch(2).as_numpy_iterator():
    for k in keys:
      chunks[k].append(batch[k])
  out = {}
  for k in keys:
    if chunks[k]:
      out[k] = np.concatenate(chunks[k], axis=0)
    else:  # empty split: keep the shape's trailing dims.
      spec = ds.element_spec[k]
      out[k] = np.zeros([0, *spec.shape], spec.dtype.as_numpy_dtype)
  return out


def load_task_arrays(task_or_mixture_name: str, split: str,
                     task_feature_lengths: Mapping[str, int], *,
                     pack: bool = False) -> dict[str, np.ndarray]:
  """Tokenized split of a registered task/mixture as encoder-decoder features.

  Runs `get_dataset(task_feature_lengths, split=split, shuffle=False,
  use_cached=False, seed=0)` (deterministic order: the source's order) and
  `seqio.EncDecFeatureConverter(pack=pack)`.

  Args:
    task_or_mixture_name: a registered seqio task or mixture.
    split: e.g. "train" or "validation".
    task_feature_lengths: e.g. `{"inputs": 384, "targets": 128}`.
    pack: pack several examples per row (adds `*_segment_ids`/`*_positions`).

  Returns:
    `encoder_input_tokens [N, Li]`, `decoder_input_tokens [N, Lt]`
    (targets shifted right, starting with 0), `decoder_target_tokens [N, Lt]`
    as int32 and `decoder_loss_weights [N, Lt]` as float32 (1 on target
    tokens, 0 on padding); with `pack`, also the int32 segment-id/position
    arrays of the converter.
  """
  provider = seqio.get_mixture_or_task(task_or_mixture_name)
  lengths = dict(task_feature_lengths)
  ds = provider.get_dataset(lengths, split=split, shuffle=False,
                            use_cached=False, seed=0)
  converter = seqio.EncDecFeatureConverter(pack=pack)
  ds = converter(ds, lengths)
  keys = [k for k in ds.element_spec if k in ENC_DEC_FEATURES
          or k.endswith(("_segment_ids", "_positions"))]
  arrays = _to_numpy(ds, sorted(keys))
  for k, v in arrays.items():
    dtype = np.float32 if k == "decoder_loss_weights" else np.int32
    arrays[k] = v.astype(dtype, copy=False)
  return arrays


def load_task_inputs(task_name: str, split: str, input_length: int
                     ) -> tuple[np.ndarray, list[dict[str, Any]]]:
  """Encoder inputs of each distinct document of a split, for generation.

  One row per distinct `pid` (the first example of each pid, in the task's
  deterministic order); a task without a `pid` feature gives one row per
  example. Targets (the real, private queries) are not returned.

  Args:
    task_name: a registered seqio task (e.g. "msmarco_query_generation").
    split: e.g. "train": generate one synthetic query per training document.
    input_length: encoder length; longer inputs are trimmed (keeping EOS).

  Returns:
    `tokens` int32 `[N, input_length]` (zero-padded, EOS-terminated) and a
    list of N metadata dicts: `{"pid": int, "index": example index,
    "inputs_pretokenized": str}` (`pid` absent if the task has none).
  """
  provider = seqio.get_mixture_or_task(task_name)
  # Targets are not needed: leave them untrimmed (None).
  lengths = {k: None for k in provider.output_features}
  lengths["inputs"] = int(input_length)
  ds = provider.get_dataset(lengths, split=split, shuffle=False,
                            use_cached=False, seed=0)
  ds = seqio.utils.trim_and_pad_dataset(ds, {"inputs": int(input_length)})
  keys = ["inputs"] + [k for k in ("pid", "inputs_pretokenized")
                       if k in ds.element_spec]
  arrays = _to_numpy(ds, keys)
  if "pid" in arrays:
    _, first = np.unique(arrays["pid"], return_index=True)
    rows = np.sort(first)
  else:
    rows = np.arange(len(arrays["inputs"]))
  tokens = arrays["inputs"][rows].astype(np.int32)
  info = []
  for r in rows:
    meta: dict[str, Any] = {"index": int(r)}
    if "pid" in arrays:
      meta["pid"] = int(arrays["pid"][r])
    if "inputs_pretokenized" in arrays:
      meta["inputs_pretokenized"] = arrays["inputs_pretokenized"][r].decode(
          "utf-8")
    info.append(meta)
  return tokens, info
