"""SST-2 and AG News readers and the label conditioning of "DP Conditional
Text Generation for Synthetic Data" (an ICLR 2023 submission, OpenReview
LUql3ZOFwFD).

The published files, per dataset:

* SST-2, GLUE's TSV files: `train.tsv` and `dev.tsv`, UTF-8, a header line
  naming the columns (`sentence\\tlabel`), then one `sentence \\t label` per
  line with label 0 (negative) or 1 (positive); no quoting (a sentence may
  hold `"`). GLUE's `test.tsv` has no labels, so `dev.tsv` is the held-out
  "test" split here.
* AG News, the published CSV files (Zhang et al., 2015) `train.csv` and
  `test.csv`: no header, one record per line, `"class index","title",
  "description"`, every field quoted (`""` inside a field is a quote), class
  index 1..4 = World, Sports, Business, Sci/Tech. The text is
  `title + " " + description`.

Whitespace runs in a text become one space; the text is otherwise kept as in
the file (AG News keeps its backslash artefacts). The paper re-splits each
dataset 80:20; the published splits are used as they are.

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

Pure Python and numpy (no TensorFlow); `tasks.textcls` registers the seqio
tasks `{dataset}_conditional_lm` and reads TFDS's copies of the datasets.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from typing import Iterator, Sequence

import numpy as np

from dpjax.data.readers import SAMPLE_DATA_DIR, malformed
from dpjax.data.readers.malformed import MalformedLineError  # noqa: F401  (raised)

SAMPLE_DIR = os.path.join(SAMPLE_DATA_DIR, "textcls_sample")
DEFAULT_DATA_DIRS = {"sst2": os.path.join(SAMPLE_DIR, "sst2"),
                     "ag_news": os.path.join(SAMPLE_DIR, "ag_news")}
DEFAULT_BPE_VOCAB_PATH = os.path.join(SAMPLE_DIR, "bpe", "vocab.json")
DEFAULT_BPE_MERGES_PATH = os.path.join(SAMPLE_DIR, "bpe", "merges.txt")

DATASETS = ("sst2", "ag_news")
SPLITS = ("train", "test")
SPLIT_FILES = {"sst2": {"train": "train.tsv", "test": "dev.tsv"},
               "ag_news": {"train": "train.csv", "test": "test.csv"}}
# Class names in label-id order (GLUE's and AG News' own orders).
LABELS = {"sst2": ("negative", "positive"),
          "ag_news": ("world", "sports", "business", "sci/tech")}

BOS_TOKEN = "<|endoftext|>"  # GPT-2's BOS (= EOS), prepended by the converter
SEP_TOKEN = "<|sep|>"
LABEL_POSITION = 1  # of the label token in a converted row
TEXT_START = 3  # first text position in a converted row


def label_token(label: str) -> str:
  """The token of class `label`: `<|label|>`."""
  return f"<|{label}|>"


EXTRA_TOKENS = (SEP_TOKEN, *(label_token(name) for d in DATASETS for name in LABELS[d]))


@dataclasses.dataclass(frozen=True)
class Example:
  """One labelled text; `label` indexes `LABELS[dataset]`."""
  text: str
  label: int  # 0-based index into LABELS[dataset]


def check_dataset(dataset: str) -> None:
  """Raises ValueError unless `dataset` is one of `DATASETS`."""
  if dataset not in DATASETS:
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


def clean_text(text: str) -> str:
  """Whitespace runs become one space."""
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
        yield Example(clean_text(fields[text_col]), int(fields[label_col]))
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
      elif not clean_text(fields[1] + " " + fields[2]):
        policy(path, lineno, "empty title and description")
      else:
        yield Example(clean_text(fields[1] + " " + fields[2]), int(fields[0]) - 1)
  finally:
    policy.report()


READERS = {"sst2": read_sst2_tsv, "ag_news": read_ag_news_csv}


def split_path(dataset: str, split: str, data_dir: str | None = None) -> str:
  """The file of `split` ("train" or "test") in a dataset directory."""
  check_dataset(dataset)
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  path = os.path.join(data_dir or DEFAULT_DATA_DIRS[dataset], SPLIT_FILES[dataset][split])
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{dataset} file not found: {path!r} (a directory holds "
                            f"{' and '.join(SPLIT_FILES[dataset].values())})")
  return path


def load_examples(dataset: str, split: str, data_dir: str | None = None, *,
                  on_malformed: str = "fail") -> list[Example]:
  """The examples of one split of the published files, in file order.

  Args:
    dataset: "sst2" or "ag_news".
    split: "train" or "test" (SST-2: GLUE's dev set).
    data_dir: directory of the published files; None means the embedded
      sample.
    on_malformed: "fail" or "skip" (see the readers).
  """
  check_dataset(dataset)
  return list(READERS[dataset](split_path(dataset, split, data_dir),
                               on_malformed=on_malformed))


# ---------------------------------------------------------------------------
# Conditioning.
# ---------------------------------------------------------------------------


def conditioning_prompt(dataset: str, label: int) -> str:
  """The task's `inputs`: `<|label|><|sep|>` (the converter prepends BOS)."""
  return label_token(LABELS[dataset][label]) + SEP_TOKEN


def conditioning_string(dataset: str, label: int, text: str) -> str:
  """The paper's training string `BOS label SEP text`, as one string."""
  return BOS_TOKEN + conditioning_prompt(dataset, label) + text


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
  check_dataset(dataset)
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


__all__ = [
    "SAMPLE_DIR", "DEFAULT_DATA_DIRS", "DEFAULT_BPE_VOCAB_PATH",
    "DEFAULT_BPE_MERGES_PATH", "DATASETS", "SPLITS", "SPLIT_FILES", "LABELS",
    "BOS_TOKEN", "SEP_TOKEN", "LABEL_POSITION", "TEXT_START", "EXTRA_TOKENS",
    "Example", "MalformedLineError", "label_token", "check_dataset",
    "clean_text", "read_sst2_tsv", "read_ag_news_csv", "READERS",
    "split_path", "load_examples", "conditioning_prompt",
    "conditioning_string", "token_id", "label_token_ids", "prompt_tokens",
]
