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

from dpjax.models import dual_encoder  # noqa: E402

ENC_DEC_FEATURES = (
    "encoder_input_tokens",
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
)
DECODER_ONLY_FEATURES = ("tokens", "loss_weights", "attention_mask")
DUAL_ENCODER_FEATURES = ("queries", "documents")
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


def ragged_rows(rows) -> tf.RaggedTensor:
  """Variable-length token rows as one int32 ragged tensor: a task source's
  feature (no rows: an empty tensor)."""
  lengths = np.array([len(r) for r in rows], np.int64)
  values = (np.concatenate(rows).astype(np.int32) if len(rows)
            else np.zeros([0], np.int32))
  return tf.RaggedTensor.from_row_lengths(values, lengths)


def registered_names() -> list[str]:
  """The registered seqio tasks and mixtures, sorted."""
  return sorted({*seqio.TaskRegistry.names(), *seqio.MixtureRegistry.names()})


def load_task_arrays(task_or_mixture_name: str, split: str,
                     task_feature_lengths: Mapping[str, int], *,
                     pack: bool = False,
                     converter: str | dual_encoder.PairGroups = "encoder_decoder"
                     ) -> dict[str, np.ndarray]:
  """Tokenized split of a registered task/mixture as model features.

  Runs `get_dataset(task_feature_lengths, split=split, shuffle=False,
  use_cached=False, seed=0)` (deterministic order: the source's order), then
  the feature converter the model needs.

  Args:
    task_or_mixture_name: a registered seqio task or mixture.
    split: e.g. "train" or "validation".
    task_feature_lengths: e.g. `{"inputs": 384, "targets": 128}`.
    pack: pack several examples per row (encoder-decoder only; adds
      `*_segment_ids`/`*_positions`).
    converter: "encoder_decoder" (T5: `seqio.EncDecFeatureConverter`),
      "decoder_only" (GPT-2: see `decoder_only_features`) or a
      `dual_encoder.PairGroups` (rows of grouped query/document pairs of
      `dual_encoder_features`).

  Returns:
    encoder-decoder: `encoder_input_tokens [N, Li]`, `decoder_input_tokens
    [N, Lt]` (targets shifted right, starting with 0), `decoder_target_tokens
    [N, Lt]` as int32 and `decoder_loss_weights [N, Lt]` as float32 (1 on
    target tokens, 0 on padding); with `pack`, also the int32
    segment-id/position arrays of the converter. Decoder-only: the arrays of
    `decoder_only_features`. Dual encoder: `PairGroups.rows` of
    `dual_encoder_features`.
  """
  provider = seqio.get_mixture_or_task(task_or_mixture_name)
  lengths = dict(task_feature_lengths)
  ds = provider.get_dataset(lengths, split=split, shuffle=False,
                            use_cached=False, seed=0)
  if isinstance(converter, dual_encoder.PairGroups):
    if pack:
      raise ValueError("packing is not supported for dual-encoder features")
    pairs = dual_encoder_features(ds, lengths)
    return converter.rows(pairs["queries"], pairs["documents"])
  if converter == "decoder_only":
    if pack:
      raise ValueError("packing is not supported for decoder-only features")
    return decoder_only_features(ds, lengths,
                                 bos_id=provider.output_features[
                                     "targets"].vocabulary.eos_id)
  if converter != "encoder_decoder":
    raise ValueError(f"unknown feature converter {converter!r}")
  ds = seqio.EncDecFeatureConverter(pack=pack)(ds, lengths)
  keys = [k for k in ds.element_spec if k in ENC_DEC_FEATURES
          or k.endswith(("_segment_ids", "_positions"))]
  arrays = _to_numpy(ds, sorted(keys))
  for k, v in arrays.items():
    dtype = np.float32 if k == "decoder_loss_weights" else np.int32
    arrays[k] = v.astype(dtype, copy=False)
  return arrays


def load_task_column(task_or_mixture_name: str, split: str,
                     task_feature_lengths: Mapping[str, int],
                     column: str) -> np.ndarray:
  """[N] values of one passthrough feature of a split (e.g. the user each
  example belongs to), in `load_task_arrays`' order: the same
  `get_dataset` call, one value per example. A task without the feature is
  a ValueError naming the ones it has."""
  provider = seqio.get_mixture_or_task(task_or_mixture_name)
  ds = provider.get_dataset(dict(task_feature_lengths), split=split,
                            shuffle=False, use_cached=False, seed=0)
  if column not in ds.element_spec:
    raise ValueError(
        f"{task_or_mixture_name} has no feature {column!r} (its features: "
        f"{sorted(ds.element_spec)})")
  if ds.element_spec[column].shape.rank != 0:
    raise ValueError(f"{task_or_mixture_name}: feature {column!r} must hold "
                     "one value per example")
  return _to_numpy(ds, [column])[column]


def decoder_only_features(ds: tf.data.Dataset, lengths: Mapping[str, int], *,
                          bos_id: int) -> dict[str, np.ndarray]:
  """Prompt + target packed into one causal-LM row per example.

  Row `i` is `[bos] + inputs[:Li - 1] + targets[:Lt]`, right-padded to
  `Li + Lt` with `bos_id` (GPT-2 has no padding id: its `<|endoftext|>` is
  BOS, EOS and padding at once, so which tokens are real is carried by
  `attention_mask`, never inferred from ids). `inputs` (the prompt) is
  optional and may be empty; `targets` should end with EOS. Returns int32
  `tokens [N, Li + Lt]`, float32 `loss_weights` (1 exactly on the target
  tokens: the model is scored on predicting them, never the prompt) and int32
  `attention_mask` (1 on real tokens). A task without `inputs` counts as
  `Li = 1` (the BOS alone).
  """
  prompt_len = int(lengths.get("inputs", 1))
  target_len = int(lengths["targets"])
  if prompt_len < 1 or target_len < 1:
    raise ValueError(f"decoder-only feature lengths must be >= 1: {dict(lengths)}")
  has_inputs = "inputs" in ds.element_spec

  def trim(ex):
    out = {"targets": ex["targets"][:target_len]}
    out["inputs"] = (ex["inputs"][:prompt_len - 1] if has_inputs
                     else tf.zeros([0], ex["targets"].dtype))
    out["n_in"] = tf.size(out["inputs"])
    out["n_tg"] = tf.size(out["targets"])
    return out

  ds = seqio.utils.trim_and_pad_dataset(
      ds.map(trim), {"inputs": prompt_len, "targets": target_len})
  a = _to_numpy(ds, ["inputs", "targets", "n_in", "n_tg"])
  n_in, n_tg = a["n_in"][:, None], a["n_tg"][:, None]
  pos = np.arange(prompt_len + target_len)[None, :]
  # Position p holds bos (p == 0), inputs[p - 1] (p <= n_in), then
  # targets[p - 1 - n_in]; gathers with clipped indices, then select.
  from_inputs = np.take_along_axis(
      a["inputs"], np.clip(pos - 1, 0, prompt_len - 1).repeat(len(n_in), 0), 1)
  from_targets = np.take_along_axis(
      a["targets"], np.clip(pos - 1 - n_in, 0, target_len - 1), 1)
  is_input = (pos >= 1) & (pos <= n_in)
  is_target = (pos > n_in) & (pos <= n_in + n_tg)
  tokens = np.where(is_input, from_inputs,
                    np.where(is_target, from_targets, bos_id))
  return {"tokens": tokens.astype(np.int32),
          "loss_weights": is_target.astype(np.float32),
          "attention_mask": (pos <= n_in + n_tg).astype(np.int32)}


def dual_encoder_features(ds: tf.data.Dataset, lengths: Mapping[str, int]
                          ) -> dict[str, np.ndarray]:
  """int32 `queries [N, Lq]` and `documents [N, Ld]`, one row per pair.

  Each feature trimmed to its length (`lengths["queries"]`,
  `lengths["documents"]`) and zero-padded; EOS is kept by the task's
  `append_eos_after_trim`.
  """
  missing = [k for k in DUAL_ENCODER_FEATURES if k not in lengths]
  if missing:
    raise ValueError(f"dual-encoder feature lengths need {missing}, got "
                     f"{dict(lengths)}")
  lengths = {k: int(lengths[k]) for k in DUAL_ENCODER_FEATURES}
  ds = seqio.utils.trim_and_pad_dataset(
      ds.map(lambda ex: {k: ex[k] for k in DUAL_ENCODER_FEATURES}), lengths)
  return {k: v.astype(np.int32, copy=False) for k, v in
          _to_numpy(ds, DUAL_ENCODER_FEATURES).items()}


def real_token_counts(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
  """`[N]` real (non-padding) tokens per example (per row of pairs for the
  dual encoder), for throughput reporting."""
  if "pair_mask" in arrays:
    return ((arrays["query_tokens"] > 0).sum((1, 2))
            + (arrays["document_tokens"] > 0).sum((1, 2))).astype(np.int64)
  if "attention_mask" in arrays:
    return arrays["attention_mask"].sum(-1).astype(np.int64)
  return ((arrays["encoder_input_tokens"] > 0).sum(-1)
          + (arrays["decoder_loss_weights"] > 0).sum(-1)).astype(np.int64)


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
