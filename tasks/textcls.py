"""The label-conditioned LM tasks of "DP Conditional Text Generation for
Synthetic Data" (an ICLR 2023 submission, OpenReview LUql3ZOFwFD) on SST-2 and
AG News.

Sources, per dataset (`source="files"`, the default, or `"tfds"`): the
published files, read by `dpjax.data.readers.textcls`, or TFDS's copies
(`glue/sst2`, splits train / validation; `ag_news_subset`, 0-based labels in
the same order, splits train / test). TFDS is optional: nothing can be
downloaded here, so `source="tfds"` needs the dataset already prepared under
`tfds_data_dir` (TFDS's default when None) and fails with a clear error
otherwise.

Task `{dataset}_conditional_lm` (decoder-only): `inputs` the prompt
`<|label|><|sep|>` (no EOS), `targets` the text + EOS, passthrough `label`
(int64, 0-based); see `dpjax.data.readers.textcls` for the conditioning. The
feature converter masks the prompt out of the LM loss.

seqio/TF (and TFDS) are imported when a task or TFDS split is used, so
importing this module, for its gin configurables, does not import
TensorFlow.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import gin
import numpy as np

from dpjax.data.readers import textcls
from dpjax.data.readers.textcls import (
    DATASETS,
    DEFAULT_BPE_MERGES_PATH,
    DEFAULT_BPE_VOCAB_PATH,
    EXTRA_TOKENS,
    LABELS,
    SPLITS,
    Example,
)

TFDS_NAMES = {"sst2": "glue/sst2", "ag_news": "ag_news_subset"}
TFDS_SPLITS = {"sst2": {"train": "train", "test": "validation"},
               "ag_news": {"train": "train", "test": "test"}}
SOURCES = ("files", "tfds")
TASK_FEATURE_LENGTHS = {"sst2": {"inputs": 3, "targets": 64},
                        "ag_news": {"inputs": 3, "targets": 128}}


def tfds_examples(dataset: str, split: str, tfds_data_dir: str | None) -> list[Example]:
  """The examples of one split of TFDS's copy of `dataset`, in TFDS order."""
  import tensorflow_datasets as tfds  # lazy: TensorFlow

  builder = tfds.builder(TFDS_NAMES[dataset], data_dir=tfds_data_dir)
  if not builder.is_prepared():
    raise FileNotFoundError(
        f"TFDS {TFDS_NAMES[dataset]!r} is not prepared under "
        f"{tfds_data_dir or 'the default TFDS data_dir'}; nothing is downloaded here: "
        "prepare it elsewhere, or use source='files' with the published files")
  examples = []
  for ex in tfds.as_numpy(builder.as_dataset(split=TFDS_SPLITS[dataset][split])):
    if dataset == "sst2":
      text = ex["sentence"].decode("utf-8")
    else:
      text = ex["title"].decode("utf-8") + " " + ex["description"].decode("utf-8")
    label = int(ex["label"])
    if not 0 <= label < len(LABELS[dataset]):
      raise ValueError(f"TFDS {TFDS_NAMES[dataset]} {split}: label {label} "
                       f"(unlabelled split?)")
    examples.append(Example(textcls.clean_text(text), label))
  return examples


def load_examples(dataset: str, split: str, data_dir: str | None = None, *,
                  source: str = "files", tfds_data_dir: str | None = None,
                  on_malformed: str = "fail") -> list[Example]:
  """The examples of one split, in file (or TFDS) order.

  Args:
    dataset: "sst2" or "ag_news".
    split: "train" or "test" (SST-2: GLUE's dev set).
    data_dir: directory of the published files; None means the embedded
      sample. Ignored with `source="tfds"`.
    source: "files" or "tfds" (see the module docstring).
    tfds_data_dir: TFDS data directory (None: TFDS's default).
    on_malformed: "fail" or "skip" (see `dpjax.data.readers.textcls`' readers).
  """
  if source not in SOURCES:
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  textcls.check_dataset(dataset)
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if source == "tfds":
    return tfds_examples(dataset, split, tfds_data_dir)
  return textcls.load_examples(dataset, split, data_dir,
                               on_malformed=on_malformed)


def conditional_vocabulary(vocab_path: str = DEFAULT_BPE_VOCAB_PATH,
                           merges_path: str = DEFAULT_BPE_MERGES_PATH):
  """GPT-2 byte-level BPE with `EXTRA_TOKENS` appended (never split)."""
  from dpjax.data import vocabularies  # lazy: TensorFlow

  return vocabularies.ByteLevelBPEVocabulary(vocab_path, merges_path,
                                             extra_tokens=EXTRA_TOKENS)


def _examples_dataset(dataset: str, examples: Sequence[Example]):
  import tensorflow as tf  # lazy: TensorFlow

  n = len(examples)
  return tf.data.Dataset.from_tensor_slices({
      "inputs": tf.constant([textcls.conditioning_prompt(dataset, e.label) for e in examples],
                            tf.string, shape=[n]),
      "targets": tf.constant([e.text for e in examples], tf.string, shape=[n]),
      "label": np.asarray([e.label for e in examples], np.int64),
  })


def register_textcls_task(name: str, dataset: str, *, data_dir: str | None = None,
                          source: str = "files", tfds_data_dir: str | None = None,
                          vocabulary=None, on_malformed: str = "fail"):
  """Registers (or re-registers) one label-conditioned decoder-only task.

  Examples: `inputs` `<|label|><|sep|>`, `targets` the text (EOS after
  trimming), passthrough `label` (int64). Splits "train" and "test". Files
  (or TFDS) are read when a split is requested; registration only checks
  that the files exist.

  Args:
    name: registry name; a task already registered under it is replaced.
    dataset: "sst2" or "ag_news".
    data_dir, source, tfds_data_dir, on_malformed: see `load_examples`.
    vocabulary: a seqio vocabulary holding `EXTRA_TOKENS`; None means
      `conditional_vocabulary()` (the sample's BPE).

  Returns:
    The registered `seqio.Task`.
  """
  import seqio  # lazy: TensorFlow

  textcls.check_dataset(dataset)
  if source not in SOURCES:
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  if source == "files":
    for split in SPLITS:
      textcls.split_path(dataset, split, data_dir)  # fail fast on a wrong directory
  vocabulary = vocabulary or conditional_vocabulary()
  textcls.label_token_ids(vocabulary, dataset)  # the label tokens must be single tokens of it

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    examples = load_examples(dataset, split, data_dir, source=source,
                             tfds_data_dir=tfds_data_dir, on_malformed=on_malformed)
    if shuffle_files:
      examples = [examples[i] for i in np.random.default_rng(seed).permutation(len(examples))]
    return _examples_dataset(dataset, examples)

  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn=dataset_fn, splits=SPLITS),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      output_features={
          "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=False, required=True),
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True, required=True),
      },
      metric_fns=[],
  )


@gin.configurable(denylist=["checkpoint_tokenizer_files"])
def register_textcls_tasks(sst2_dir: str | None = None, ag_news_dir: str | None = None,
                           source: str = "files", tfds_data_dir: str | None = None,
                           bpe_vocab_path: str | None = None,
                           bpe_merges_path: str | None = None, on_malformed: str = "fail",
                           checkpoint_tokenizer_files: Mapping[str, str] | None = None
                           ) -> list:
  """Registers `sst2_conditional_lm` and `ag_news_conditional_lm`.

  Args:
    sst2_dir, ag_news_dir: directories of the published files; None means
      the embedded samples.
    source, tfds_data_dir, on_malformed: see `load_examples`.
    bpe_vocab_path, bpe_merges_path: GPT-2 `vocab.json` / `merges.txt`; None
      means the pretrained checkpoint's (`checkpoint_tokenizer_files`) if it
      has them, else the sample's. `EXTRA_TOKENS` are appended either way.
    checkpoint_tokenizer_files: `dpjax.pretrained.tokenizer_files` of the
      pretrained checkpoint, if any.
  """
  from dpjax.data import vocabularies  # lazy: TensorFlow
  vocabulary = conditional_vocabulary(*vocabularies.bpe_paths(
      bpe_vocab_path, bpe_merges_path, checkpoint_tokenizer_files,
      default_vocab=DEFAULT_BPE_VOCAB_PATH, default_merges=DEFAULT_BPE_MERGES_PATH))
  dirs = {"sst2": sst2_dir, "ag_news": ag_news_dir}
  return [register_textcls_task(f"{d}_conditional_lm", d, data_dir=dirs[d], source=source,
                                tfds_data_dir=tfds_data_dir, vocabulary=vocabulary,
                                on_malformed=on_malformed)
          for d in DATASETS]
