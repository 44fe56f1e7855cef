"""SST-2 and AG News readers and the label-conditioned LM tasks of "DP
Conditional Text Generation for Synthetic Data" (shared/papers/002).

Sources, per dataset (`source="files"`, the default, or `"tfds"`):

* SST-2, GLUE's TSV files: `train.tsv` and `dev.tsv`, UTF-8, a header line
  naming the columns (`sentence\\tlabel`), then one `sentence \\t label` per
  line with label 0 (negative) or 1 (positive); no quoting (a sentence may
  hold `"`). GLUE's `test.tsv` has no labels, so `dev.tsv` is the held-out
  "test" split here. TFDS: `glue/sst2`, splits train / validation.
* AG News, the published CSV files (Zhang et al., 2015) `train.csv` and
  `test.csv`: no header, one record per line, `"class index","title",
  "description"`, every field quoted (`""` inside a field is a quote), class
  index 1..4 = World, Sports, Business, Sci/Tech. The text is
  `title + " " + description`. TFDS: `ag_news_subset` (0-based labels, same
  order), splits train / test.

Whitespace runs in a text become one space; the text is otherwise kept as in
the file (AG News keeps its backslash artefacts). The paper re-splits each
dataset 80:20; the published splits are used as they are.

TFDS is optional: nothing can be downloaded here, so `source="tfds"` needs
the dataset already prepared under `tfds_data_dir` (TFDS's default when
None) and fails with a clear error otherwise.

Conditioning (Keskar et al.'s "BOS label SEP text", paper Sec. 5.1): a
training row is

    <|endoftext|> <|positive|> <|sep|> the film is a delight ... <|endoftext|>
    position 0    1 (LABEL_POSITION)  2   3 = TEXT_START ...

BOS is GPT-2's own `<|endoftext|>` (its BOS, EOS and padding; the GPT-2
feature converter prepends it); SEP is the new token `<|sep|>`; the label is
one new token per class, `<|negative|>`, ..., `<|sci/tech|>`. Label tokens
are single tokens in any vocabulary, so the label slot is one position
wherever it appears and replacing it by a random token (the discriminator's
input, `dpjax.models.gpt2_disc`) cannot shift the text. `EXTRA_TOKENS` (SEP,
then every label token of both datasets) are appended to the byte-level BPE
as extra tokens (never split; ids from the BPE's size up); a pretrained
GPT-2 embedding needs `len(EXTRA_TOKENS)` more rows.

Task `{dataset}_conditional_lm` (decoder-only): `inputs` the prompt
`<|label|><|sep|>` (no EOS), `targets` the text + EOS, passthrough `label`
(int64, 0-based). The feature converter masks the prompt out of the LM loss.

Readers are pure Python (no TensorFlow); seqio/TF (and TFDS) are imported
when a task or TFDS split is used.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from typing import Iterator, Mapping, Sequence

import gin
import numpy as np

from tasks import malformed
from tasks.malformed import MalformedLineError  # noqa: F401  (re-exported)

SAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                          "textcls_sample")
DEFAULT_DATA_DIRS = {"sst2": os.path.join(SAMPLE_DIR, "sst2"),
                     "ag_news": os.path.join(SAMPLE_DIR, "ag_news")}
DEFAULT_BPE_VOCAB_PATH = os.path.join(SAMPLE_DIR, "bpe", "vocab.json")
DEFAULT_BPE_MERGES_PATH = os.path.join(SAMPLE_DIR, "bpe", "merges.txt")

DATASETS = ("sst2", "ag_news")
SPLITS = ("train", "test")
SPLIT_FILES = {"sst2": {"train": "train.tsv", "test": "dev.tsv"},
               "ag_news": {"train": "train.csv", "test": "test.csv"}}
TFDS_NAMES = {"sst2": "glue/sst2", "ag_news": "ag_news_subset"}
TFDS_SPLITS = {"sst2": {"train": "train", "test": "validation"},
               "ag_news": {"train": "train", "test": "test"}}
SOURCES = ("files", "tfds")
# Class names in label-id order (GLUE's and AG News' own orders).
LABELS = {"sst2": ("negative", "positive"),
          "ag_news": ("world", "sports", "business", "sci/tech")}

BOS_TOKEN = "<|endoftext|>"  # GPT-2's BOS (= EOS), prepended by the converter
SEP_TOKEN = "<|sep|>"
LABEL_POSITION = 1  # of the label token in a converted row
TEXT_START = 3  # first text position in a converted row
TASK_FEATURE_LENGTHS = {"sst2": {"inputs": 3, "targets": 64},
                        "ag_news": {"inputs": 3, "targets": 128}}


def label_token(label: str) -> str:
  return f"<|{label}|>"


EXTRA_TOKENS = (SEP_TOKEN, *(label_token(name) for d in DATASETS for name in LABELS[d]))


@dataclasses.dataclass(frozen=True)
class Example:
  text: str
  label: int  # 0-based index into LABELS[dataset]


def _check_dataset(dataset: str) -> None:
  if dataset not in DATASETS:
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


def _clean(text: str) -> str:
  return " ".join(text.split())


def read_sst2_tsv(path: str, *, on_malformed: str = "fail") -> Iterator[Example]:
  """Streams the examples of a GLUE SST-2 TSV file (header, then
  `sentence \\t label`; columns found by name).

  on_malformed: "fail" raises `MalformedLineError("path:line: reason")` for a
  line that is not UTF-8, has other than the header's column count, an empty
  sentence or a label other than 0/1; "skip" drops such lines and logs one
  warning with their count and the first location. A header without
  `sentence` and `label` columns always raises.
  """
  policy = malformed.MalformedPolicy(on_malformed, f"lines in {path}")
  lines = malformed.decoded_lines(path, policy)
  try:
    first = next(lines, None)
    header = [] if first is None else first[1].lstrip("\ufeff").split("\t")
    if "sentence" not in header or "label" not in header:
      raise MalformedLineError(path, first[0] if first else 1, (
          f"expected a header with 'sentence' and 'label' columns, got {header} "
          "(GLUE's test.tsv has no labels)"))
    text_col, label_col = header.index("sentence"), header.index("label")
    for lineno, line in lines:
      fields = line.split("\t")
      if len(fields) != len(header):
        policy(path, lineno, f"expected {len(header)} tab-separated columns, "
               f"got {len(fields)}")
      elif fields[label_col].strip() not in ("0", "1"):
        policy(path, lineno, f"label must be 0 or 1, got {fields[label_col]!r}")
      elif not fields[text_col].strip():
        policy(path, lineno, "empty sentence")
      else:
        yield Example(_clean(fields[text_col]), int(fields[label_col]))
  finally:
    policy.report()


def read_ag_news_csv(path: str, *, on_malformed: str = "fail") -> Iterator[Example]:
  """Streams the examples of an AG News CSV file (`"class index","title",
  "description"`, class index 1..4 -> label 0..3).

  on_malformed: "fail" raises `MalformedLineError("path:line: reason")` for a
  line that is not UTF-8, breaks CSV quoting, has other than 3 fields, a
  class index outside 1..4 or an empty title and description; "skip" drops
  such lines and logs one warning with their count and the first location.
  """
  policy = malformed.MalformedPolicy(on_malformed, f"lines in {path}")
  num_classes = len(LABELS["ag_news"])
  try:
    for lineno, line in malformed.decoded_lines(path, policy):
      try:
        fields = next(csv.reader([line], strict=True))
      except csv.Error as e:
        policy(path, lineno, f"malformed CSV ({e})")
        continue
      if len(fields) != 3:
        policy(path, lineno, f"expected 3 fields (class index, title, description), "
               f"got {len(fields)}")
      elif fields[0].strip() not in {str(c) for c in range(1, num_classes + 1)}:
        policy(path, lineno, f"class index must be 1..{num_classes}, got {fields[0]!r}")
      elif not _clean(fields[1] + " " + fields[2]):
        policy(path, lineno, "empty title and description")
      else:
        yield Example(_clean(fields[1] + " " + fields[2]), int(fields[0]) - 1)
  finally:
    policy.report()


READERS = {"sst2": read_sst2_tsv, "ag_news": read_ag_news_csv}


def split_path(dataset: str, split: str, data_dir: str | None = None) -> str:
  """The file of `split` ("train" or "test") in a dataset directory."""
  _check_dataset(dataset)
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  path = os.path.join(data_dir or DEFAULT_DATA_DIRS[dataset], SPLIT_FILES[dataset][split])
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{dataset} file not found: {path!r} (a directory holds "
                            f"{' and '.join(SPLIT_FILES[dataset].values())})")
  return path


def _tfds_examples(dataset: str, split: str, tfds_data_dir: str | None) -> list[Example]:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

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
    examples.append(Example(_clean(text), label))
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
    on_malformed: "fail" or "skip" (see the readers).
  """
  if source not in SOURCES:
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  _check_dataset(dataset)
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if source == "tfds":
    return _tfds_examples(dataset, split, tfds_data_dir)
  return list(READERS[dataset](split_path(dataset, split, data_dir),
                               on_malformed=on_malformed))


# ---------------------------------------------------------------------------
# Conditioning and seqio tasks.
# ---------------------------------------------------------------------------


def conditioning_prompt(dataset: str, label: int) -> str:
  """The task's `inputs`: `<|label|><|sep|>` (the converter prepends BOS)."""
  return label_token(LABELS[dataset][label]) + SEP_TOKEN


def conditioning_string(dataset: str, label: int, text: str) -> str:
  """The paper's training string `BOS label SEP text`, as one string."""
  return BOS_TOKEN + conditioning_prompt(dataset, label) + text


def conditional_vocabulary(vocab_path: str = DEFAULT_BPE_VOCAB_PATH,
                           merges_path: str = DEFAULT_BPE_MERGES_PATH):
  """GPT-2 byte-level BPE with `EXTRA_TOKENS` appended (never split)."""
  from dpjax.data import vocabularies  # pylint: disable=g-import-not-at-top

  return vocabularies.ByteLevelBPEVocabulary(vocab_path, merges_path,
                                             extra_tokens=EXTRA_TOKENS)


def token_id(vocabulary, token: str) -> int:
  """The id of a special token, which must encode to exactly one id."""
  ids = list(vocabulary.encode(token))
  if len(ids) != 1:
    raise ValueError(f"{token!r} is not a single token of {vocabulary} (encodes to {ids}); "
                     "use conditional_vocabulary()")
  return int(ids[0])


def label_token_ids(vocabulary, dataset: str) -> tuple[int, ...]:
  """Token id of each class of `dataset`, in label order (for
  `gpt2_disc.GPT2DiscConfig.label_token_ids`)."""
  _check_dataset(dataset)
  return tuple(token_id(vocabulary, label_token(name)) for name in LABELS[dataset])


def prompt_tokens(vocabulary, dataset: str, labels: Sequence[int]) -> np.ndarray:
  """int32 `[n, 3]` generation prompts `BOS label SEP`, one per label."""
  ids = np.asarray(label_token_ids(vocabulary, dataset), np.int32)
  labels = np.asarray(labels, np.int64)
  if labels.size and not (labels.min() >= 0 and labels.max() < len(ids)):
    raise ValueError(f"labels must be in 0..{len(ids) - 1} for {dataset}")
  n = len(labels)
  return np.stack([np.full(n, vocabulary.bos_id, np.int32), ids[labels],
                   np.full(n, token_id(vocabulary, SEP_TOKEN), np.int32)], axis=1)


def _examples_dataset(dataset: str, examples: Sequence[Example]):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  n = len(examples)
  return tf.data.Dataset.from_tensor_slices({
      "inputs": tf.constant([conditioning_prompt(dataset, e.label) for e in examples],
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
  import seqio  # pylint: disable=g-import-not-at-top

  _check_dataset(dataset)
  if source not in SOURCES:
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  if source == "files":
    for split in SPLITS:
      split_path(dataset, split, data_dir)  # fail fast on a wrong directory
  vocabulary = vocabulary or conditional_vocabulary()
  label_token_ids(vocabulary, dataset)  # the label tokens must be single tokens of it

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
  from dpjax.data import vocabularies  # pylint: disable=g-import-not-at-top
  vocabulary = conditional_vocabulary(*vocabularies.bpe_paths(
      bpe_vocab_path, bpe_merges_path, checkpoint_tokenizer_files,
      default_vocab=DEFAULT_BPE_VOCAB_PATH, default_merges=DEFAULT_BPE_MERGES_PATH))
  dirs = {"sst2": sst2_dir, "ag_news": ag_news_dir}
  return [register_textcls_task(f"{d}_conditional_lm", d, data_dir=dirs[d], source=source,
                                tfds_data_dir=tfds_data_dir, vocabulary=vocabulary,
                                on_malformed=on_malformed)
          for d in DATASETS]
