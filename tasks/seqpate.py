"""SeqPATE's seqio task ("SeqPATE: Differentially Private Text Generation
via Knowledge Distillation"): `register_private_lm_task` registers the task
of one seed's private split (`dpjax.data.readers.seqpate.completion_splits`) for
dpjax's trainer (the NoisySGD baselines): the same sentences the teachers
see, as the same rows `encode_completions` makes.

TensorFlow (through `dpjax.data.vocabularies` and seqio) is imported only by
`sample_vocabulary` and `register_private_lm_task`.
"""
from __future__ import annotations

import os

import numpy as np

from dpjax.data.readers.seqpate import DEFAULT_VOCAB_DIR, completion_splits

PRIVATE_LM_TASK = "seqpate_private_lm"
# AirDialogue's examples carry their customer's name here, the unit of
# user-level DP (`train.privacy_unit = 'user'`); Europarl has no users.
USER_COLUMN = "user_id"


def register_private_lm_task(dataset: str, seed: int, *,
                             public_fraction: float, test_fraction: float,
                             max_examples: int | None = None,
                             vocabulary=None, name: str = PRIVATE_LM_TASK):
  """Registers (or re-registers) the decoder-only LM task of a private split.

  Splits: "train", the private examples of `completion_splits(dataset, seed,
  ...)` (the first `max_examples` of them, as the table caps them), and
  "test". An example is `inputs` empty and `targets` = the BPE ids of its
  text + EOS; with task feature lengths `{"targets": L - 1}` the trainer's
  decoder-only rows are `encode_completions(examples, vocabulary, L)`'s
  (BOS, text, EOS, cut at L, loss on every token after BOS). AirDialogue
  examples also carry `user_id`, the customer's name.
  `vocabulary`: a seqio vocabulary; None means `sample_vocabulary()`.
  """
  import seqio  # lazy: TensorFlow
  import tensorflow as tf  # lazy: TensorFlow

  vocabulary = vocabulary or sample_vocabulary()
  splits = completion_splits(dataset, seed, public_fraction=public_fraction,
                             test_fraction=test_fraction)
  examples = {"train": splits["private"][:max_examples],
              "test": splits["test"]}

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    rows = examples[split]
    if shuffle_files:
      rows = [rows[i] for i in np.random.default_rng(seed).permutation(
          len(rows))]
    ids = [np.asarray(list(vocabulary.encode(e.text)) + [vocabulary.eos_id],
                      np.int32) for e in rows]
    features = {"inputs": tf.zeros([len(ids), 0], tf.int32),
                "targets": tf.RaggedTensor.from_row_lengths(
                    np.concatenate(ids), [len(i) for i in ids])}
    if rows and all(e.user_id is not None for e in rows):
      features[USER_COLUMN] = tf.constant([e.user_id for e in rows])
    return tf.data.Dataset.from_tensor_slices(features)

  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn=dataset_fn,
                                      splits=tuple(examples)),
      preprocessors=[],
      output_features={
          "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=False),
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=False)},
      metric_fns=[])


def sample_vocabulary():
  """The embedded sample's byte-level BPE (GPT-2 format, EOS last)."""
  from dpjax.data import vocabularies  # lazy: TensorFlow

  return vocabularies.ByteLevelBPEVocabulary(
      os.path.join(DEFAULT_VOCAB_DIR, "vocab.json"),
      os.path.join(DEFAULT_VOCAB_DIR, "merges.txt"))


__all__ = ["PRIVATE_LM_TASK", "register_private_lm_task", "sample_vocabulary"]
