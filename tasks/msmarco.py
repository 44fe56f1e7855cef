"""MSMARCO passage-ranking readers and the seqio query-generation task.

Data layer only: this module (like everything under `tasks/` and
`dpjax/data/`) may import TensorFlow and seqio. The DP core -- `dpjax.privacy`,
`dpjax.models` and the train step -- never does; it receives numpy arrays
(see `dpjax.data.arrays`).

Files follow the published MSMARCO passage-ranking layout, all UTF-8, tab
separated, one record per line:

* `collection.tsv`          `pid \\t passage`
* `queries.{split}.tsv`     `qid \\t query`
* `qrels.{split}.tsv`       `qid \\t 0 \\t pid \\t relevance`  (TREC qrels)

with `split` in {"train", "dev"}. The readers are pure Python (no TF) and
memory-conscious: the qrels are read first and `collection.tsv` (8.8M passages
in the full dataset) is streamed keeping only the passages that are needed.

Two tasks, one example per relevant (query, passage) pair:

* `register_msmarco_query_generation`: the paper's document -> query
  generation task: inputs `"generate_query: " + passage`, targets the query.
* `register_msmarco_dual_encoder`: the retrieval pairs (features `queries`
  and `documents`, no prefix) for the dual encoder. Its training pairs may
  come from another directory and file split than the collection, e.g. the
  `queries.synthetic.tsv` / `qrels.synthetic.tsv` written by
  `dpjax.inference.generate_synthetic`, whose pids refer to the original
  `collection.tsv`.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import gin

from tasks import malformed

_MODULE_DIR = os.path.dirname(os.path.abspath(__file__))

DEFAULT_SAMPLE_DIR = os.path.join(_MODULE_DIR, "data", "msmarco_sample")
DEFAULT_VOCABULARY_PATH = os.path.join(
    DEFAULT_SAMPLE_DIR, "spm", "msmarco_sample.model"
)
DEFAULT_TASK_NAME = "msmarco_query_generation"
DUAL_ENCODER_TASK_NAME = "msmarco_dual_encoder"
INPUT_PREFIX = "generate_query: "
# Maximum token lengths used in the paper: 384 for documents, 128 for queries.
TASK_FEATURE_LENGTHS = {"inputs": 384, "targets": 128}

COLLECTION_FILE = "collection.tsv"
# seqio split name -> MSMARCO file split name.
SPLITS = {"train": "train", "dev": "dev", "validation": "dev"}

_ON_MALFORMED = malformed.ON_MALFORMED
MalformedLineError = malformed.MalformedLineError


class EmptyFileError(MalformedLineError):
  """A data file without a single line; message is `path: why`."""

  def __init__(self, path: str, expected: str):
    ValueError.__init__(self, f"{path}: the file is empty (expected lines "
                        f"{expected})")
    self.path, self.lineno, self.reason = path, 0, "empty file"


# What each file's lines hold (for EmptyFileError).
_LINE_FORMATS = {"collection": "pid<TAB>passage", "queries": "qid<TAB>query",
                 "qrels": "qid<TAB>0<TAB>pid<TAB>relevance"}


def _iter_fields(path: str, policy: malformed.MalformedPolicy, num_fields: int
                 ) -> Iterator[tuple[int, list[str]]]:
  """Yields (lineno, fields) of each non-blank line with `num_fields` fields."""
  for lineno, line in malformed.decoded_lines(path, policy):
    fields = line.split("\t")
    if len(fields) != num_fields:
      policy(path, lineno,
             f"expected {num_fields} tab-separated columns, got {len(fields)}")
      continue
    yield lineno, fields


def _parse_id(text: str) -> int:
  """Parses a (possibly negative) ASCII integer; ValueError(text) otherwise."""
  digits = text.strip()
  digits = digits[1:] if digits.startswith("-") else digits
  if not (digits.isascii() and digits.isdigit()):
    raise ValueError(text)
  return int(text)


def read_tsv_pairs(path: str, *, on_malformed: str = "fail",
                   keep_ids: Iterable[int] | None = None
                   ) -> Iterator[tuple[int, str]]:
  """Streams `(id, text)` from an `id \\t text` file (collection or queries).

  Args:
    path: a `collection.tsv` or `queries.*.tsv` file.
    on_malformed: "fail" raises `MalformedLineError("path:line: reason")` on a
      line with other than 2 columns, a non-integer id, empty text, a
      duplicate (kept) id or invalid UTF-8; "skip" skips such lines, and logs
      one warning with their count and the first location when the iteration
      ends.
    keep_ids: if given, only records whose id is in it are yielded (every line
      is still validated). Used to stream the 8.8M-passage collection.

  Yields:
    `(id, text)` in file order; text is stripped of surrounding whitespace.
  """
  policy = malformed.MalformedPolicy(on_malformed, f"lines in {path}")
  keep = None if keep_ids is None else set(keep_ids)
  seen: set[int] = set()
  try:
    for lineno, (id_text, text) in _iter_fields(path, policy, 2):
      try:
        rid = _parse_id(id_text)
      except ValueError:
        policy(path, lineno, f"id is not an integer: {id_text!r}")
        continue
      text = text.strip()
      if not text:
        policy(path, lineno, f"empty text for id {rid}")
        continue
      if keep is not None and rid not in keep:
        continue
      # Duplicates are only tracked among the kept ids: a set of all 8.8M
      # collection ids would cost more memory than the kept passages.
      if rid in seen:
        policy(path, lineno, f"duplicate id {rid}")
        continue
      seen.add(rid)
      yield rid, text
  finally:
    policy.report()


def read_qrels(path: str, *, on_malformed: str = "fail"
               ) -> Iterator[tuple[int, int, int, int]]:
  """Streams `(qid, pid, relevance, lineno)` from a 4-column TREC qrels file.

  MSMARCO's qrels are `qid \\t 0 \\t pid \\t relevance`; any other column count
  or a non-integer field is malformed (see `read_tsv_pairs` for
  `on_malformed`), and so is a (qid, pid) row that repeats an earlier one with
  another relevance. Rows are yielded in file order, including non-relevant
  ones (relevance <= 0); a row repeating an earlier one exactly is yielded
  once (as the BEIR qrels reader does).
  """
  policy = malformed.MalformedPolicy(on_malformed, f"lines in {path}")
  seen: dict[tuple[int, int], tuple[int, int]] = {}  # -> (relevance, lineno)
  try:
    for lineno, fields in _iter_fields(path, policy, 4):
      try:
        qid, _, pid, rel = (_parse_id(x) for x in fields)
      except ValueError as e:
        policy(path, lineno, f"qrels fields must be integers, got {e.args[0]!r}")
        continue
      previous = seen.get((qid, pid))
      if previous is not None:
        if previous[0] != rel:
          policy(path, lineno, f"({qid}, {pid}) judged {rel} here and "
                 f"{previous[0]} on line {previous[1]}")
        continue
      seen[(qid, pid)] = (rel, lineno)
      yield qid, pid, rel, lineno
  finally:
    policy.report()


def _split_files(data_dir: str, split: str, pairs_dir: str | None = None
                 ) -> dict[str, str]:
  """Checks the MSMARCO files for `split` exist; returns their paths.

  `collection.tsv` is read from `data_dir`; `queries.{name}.tsv` and
  `qrels.{name}.tsv` from `pairs_dir` (default `data_dir`), where `name` is
  MSMARCO's name of `split` ("dev" for "validation"). With a `pairs_dir`,
  `split` may be any file-name part (e.g. "synthetic").
  """
  if split in SPLITS:
    name = SPLITS[split]
  elif pairs_dir is not None and split and split.replace("_", "").replace(
      "-", "").isalnum():
    name = split
  else:
    raise ValueError(f"split must be one of {sorted(SPLITS)}"
                     f"{' or a plain file-name part' if pairs_dir else ''}, "
                     f"got {split!r}")
  dirs = {"collection": data_dir, "queries": pairs_dir or data_dir,
          "qrels": pairs_dir or data_dir}
  files = {
      "collection": COLLECTION_FILE,
      "queries": f"queries.{name}.tsv",
      "qrels": f"qrels.{name}.tsv",
  }
  expected = ", ".join(files.values())
  for d in dict.fromkeys(dirs.values()):
    if not os.path.isdir(d):
      held = ", ".join(files[k] for k in files if dirs[k] == d)
      raise FileNotFoundError(
          f"MSMARCO data directory not found: {d!r} (expected a directory "
          f"holding {held})"
      )
  paths = {k: os.path.join(dirs[k], v) for k, v in files.items()}
  missing = [p for p in paths.values() if not os.path.isfile(p)]
  if missing:
    raise FileNotFoundError(
        f"MSMARCO files missing: {', '.join(missing)} (split {split!r} "
        f"expects {expected})"
    )
  for kind, p in paths.items():
    if os.path.getsize(p) == 0:
      raise EmptyFileError(p, _LINE_FORMATS[kind])
  return paths


def _relevant_qrels(path: str, on_malformed: str
                    ) -> list[tuple[int, int, int]]:
  """`(qid, pid, lineno)` of the relevant (relevance > 0) qrels rows."""
  return [(qid, pid, lineno)
          for qid, pid, rel, lineno in read_qrels(path, on_malformed=on_malformed)
          if rel > 0]


def load_query_passage_pairs(data_dir: str, split: str, *,
                             on_malformed: str = "fail",
                             pairs_dir: str | None = None
                             ) -> list[tuple[int, int, str, str]]:
  """Joins qrels with queries and passages.

  Reads `qrels.{split}.tsv` first, then the queries, then streams
  `collection.tsv` keeping only the passages that relevant qrels refer to.

  Args:
    data_dir: directory with MSMARCO's `collection.tsv`, `queries.{split}.tsv`
      and `qrels.{split}.tsv`.
    split: "train" or "dev" ("validation" is an alias of "dev"); with
      `pairs_dir`, any file-name part (e.g. "synthetic").
    on_malformed: "fail" or "skip" (see `read_tsv_pairs`). A relevant qrels
      row whose query or passage is missing is treated as a malformed qrels
      line.
    pairs_dir: where `queries.{split}.tsv` and `qrels.{split}.tsv` are, if
      not in `data_dir` (e.g. a `generate_synthetic` output directory); the
      passages still come from `data_dir`'s `collection.tsv`.

  Returns:
    `(qid, pid, query, passage)` for each relevant (relevance > 0) qrels row,
    in qrels file order.

  Raises:
    FileNotFoundError: `data_dir` or one of the three files does not exist.
    MalformedLineError: a malformed line, with `on_malformed="fail"`.
  """
  paths = _split_files(data_dir, split, pairs_dir)
  qrels = _relevant_qrels(paths["qrels"], on_malformed)
  qids = {qid for qid, _, _ in qrels}
  queries = dict(read_tsv_pairs(paths["queries"], on_malformed=on_malformed,
                                keep_ids=qids))
  passages = dict(read_tsv_pairs(paths["collection"], on_malformed=on_malformed,
                                 keep_ids={pid for _, pid, _ in qrels}))
  policy = malformed.MalformedPolicy(on_malformed, f"qrels rows in {paths['qrels']}")
  pairs = []
  for qid, pid, lineno in qrels:
    if qid not in queries:
      policy(paths["qrels"], lineno,
             f"query {qid} not found in {os.path.basename(paths['queries'])}")
    elif pid not in passages:
      policy(paths["qrels"], lineno,
             f"passage {pid} not found in {COLLECTION_FILE}")
    else:
      pairs.append((qid, pid, queries[qid], passages[pid]))
  policy.report()
  return pairs


def load_collection_ids(data_dir: str, split: str = "train", *,
                        on_malformed: str = "fail") -> list[int]:
  """The distinct pids of the relevant qrels rows of `split`, first-seen order.

  For "train" these are the training documents: the query-generation pipeline
  generates one synthetic query per pid. Only the qrels file is read (the
  pids are not checked against `collection.tsv`; `load_query_passage_pairs`
  does that).
  """
  paths = _split_files(data_dir, split)
  return list(dict.fromkeys(
      pid for _, pid, _ in _relevant_qrels(paths["qrels"], on_malformed)))


# ---------------------------------------------------------------------------
# seqio task.
# ---------------------------------------------------------------------------


def _examples_dataset(pairs: list[tuple[int, int, str, str]],
                      query_key: str, passage_key: str, passage_prefix: str):
  """A tf.data.Dataset of {query_key, passage_key, 'qid', 'pid'} from pairs."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  return tf.data.Dataset.from_tensor_slices({
      passage_key: tf.constant([passage_prefix + p for _, _, _, p in pairs],
                               dtype=tf.string, shape=[len(pairs)]),
      query_key: tf.constant([q for _, _, q, _ in pairs], dtype=tf.string,
                             shape=[len(pairs)]),
      "qid": np.array([qid for qid, _, _, _ in pairs], dtype=np.int64),
      "pid": np.array([pid for _, pid, _, _ in pairs], dtype=np.int64),
  })


def _register_pairs_task(task_name: str, files: dict[str, tuple],
                         vocabulary_path: str, on_malformed: str, *,
                         query_key: str, passage_key: str,
                         passage_prefix: str = ""):
  """Registers (replacing) a seqio Task of (query, passage) pairs.

  `files`: seqio split -> `(data_dir, msmarco split, pairs_dir)` as taken by
  `load_query_passage_pairs`. Both text features are tokenized and get EOS
  appended after trimming; `qid` and `pid` pass through.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if on_malformed not in _ON_MALFORMED:
    raise ValueError(
        f"on_malformed must be one of {_ON_MALFORMED}, got {on_malformed!r}")
  # Fail fast on a wrong directory, and count the examples from the (small)
  # qrels files: exact unless rows get skipped as malformed.
  num_input_examples = {
      split: len(_relevant_qrels(_split_files(*where)["qrels"], on_malformed))
      for split, where in files.items()
  }
  if not tf.io.gfile.exists(vocabulary_path):
    raise FileNotFoundError(
        f"SentencePiece model not found: {vocabulary_path!r}")

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    data_dir, name, pairs_dir = files[split]
    pairs = load_query_passage_pairs(data_dir, name, on_malformed=on_malformed,
                                     pairs_dir=pairs_dir)
    if shuffle_files:
      order = np.random.default_rng(seed).permutation(len(pairs))
      pairs = [pairs[i] for i in order]
    return _examples_dataset(pairs, query_key, passage_key, passage_prefix)

  vocabulary = seqio.SentencePieceVocabulary(vocabulary_path)
  feature = seqio.Feature(vocabulary=vocabulary, add_eos=True, required=True)
  if task_name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(task_name)
  return seqio.TaskRegistry.add(
      task_name,
      source=seqio.FunctionDataSource(
          dataset_fn=dataset_fn, splits=tuple(files),
          num_input_examples=num_input_examples),
      preprocessors=[
          seqio.preprocessors.tokenize,
          seqio.preprocessors.append_eos_after_trim,
      ],
      output_features={passage_key: feature, query_key: feature},
      metric_fns=[],
  )


@gin.configurable(denylist=["checkpoint_vocabulary_path"])
def register_msmarco_query_generation(
    data_dir: str | None = DEFAULT_SAMPLE_DIR,
    vocabulary_path: str | None = DEFAULT_VOCABULARY_PATH,
    on_malformed: str = "fail",
    task_name: str = DEFAULT_TASK_NAME,
    checkpoint_vocabulary_path: str | None = None,
):
  """Registers (or re-registers) the MSMARCO query-generation seqio Task.

  Examples: `inputs = "generate_query: " + passage`, `targets = query`, plus
  the integer passthrough features `qid` and `pid`; one per relevant qrels
  row. Splits: "train" and "validation" (MSMARCO's dev). Preprocessing:
  tokenize, then append EOS after trimming to the requested length.

  Args:
    data_dir: MSMARCO directory; None means the embedded fictional sample.
    vocabulary_path: SentencePiece model (T5 ids: pad 0, eos 1); None means
      the pretrained checkpoint's `spiece.model` if there is one
      (`checkpoint_vocabulary_path`, passed by the trainer), else the
      embedded sample's vocabulary.
    on_malformed: "fail" or "skip" (see `load_query_passage_pairs`).
    task_name: registry name; a task already registered under it is replaced.
    checkpoint_vocabulary_path: the SentencePiece model shipped with
      INITIAL_CHECKPOINT_PATH, if any.

  Returns:
    The registered `seqio.Task`.
  """
  data_dir = DEFAULT_SAMPLE_DIR if data_dir is None else data_dir
  return _register_pairs_task(
      task_name,
      {split: (data_dir, split, None) for split in ("train", "validation")},
      vocabulary_path or checkpoint_vocabulary_path or DEFAULT_VOCABULARY_PATH,
      on_malformed, query_key="targets", passage_key="inputs",
      passage_prefix=INPUT_PREFIX)


@gin.configurable(denylist=["checkpoint_vocabulary_path"])
def register_msmarco_dual_encoder(
    data_dir: str | None = DEFAULT_SAMPLE_DIR,
    train_pairs_dir: str | None = None,
    train_pairs_split: str = "train",
    vocabulary_path: str | None = None,
    on_malformed: str = "fail",
    task_name: str = DUAL_ENCODER_TASK_NAME,
    checkpoint_vocabulary_path: str | None = None,
):
  """Registers (or re-registers) the dual encoder's MSMARCO pairs Task.

  Examples: `queries = query`, `documents = passage` (no prefix: the
  retrieval evaluation encodes raw texts), plus passthrough `qid` and `pid`;
  one per relevant qrels row. Splits: "train" (the training pairs) and
  "validation" (MSMARCO's dev pairs of `data_dir`).

  Args:
    data_dir: MSMARCO directory (`collection.tsv` and the dev pairs); None
      means the embedded fictional sample.
    train_pairs_dir: directory of the training `queries.{train_pairs_split}
      .tsv` and `qrels.{train_pairs_split}.tsv`; None means `data_dir` (the
      original pairs). For synthetic pairs: a `dpjax.infer` output directory
      with `train_pairs_split="synthetic"`.
    train_pairs_split: the file-name part of the training pairs.
    vocabulary_path: SentencePiece model; None means the pretrained
      checkpoint's (`checkpoint_vocabulary_path`), else the sample's.
    on_malformed: "fail" or "skip" (see `load_query_passage_pairs`).
    task_name: registry name; a task already registered under it is replaced.
    checkpoint_vocabulary_path: the SentencePiece model shipped with
      INITIAL_CHECKPOINT_PATH, if any.

  Returns:
    The registered `seqio.Task`.
  """
  data_dir = DEFAULT_SAMPLE_DIR if data_dir is None else data_dir
  return _register_pairs_task(
      task_name,
      {"train": (data_dir, train_pairs_split, train_pairs_dir),
       "validation": (data_dir, "validation", None)},
      vocabulary_path or checkpoint_vocabulary_path or DEFAULT_VOCABULARY_PATH,
      on_malformed, query_key="queries", passage_key="documents")


@gin.configurable
def msmarco_dual_encoder_delta(data_dir: str | None = DEFAULT_SAMPLE_DIR,
                               train_pairs_dir: str | None = None,
                               train_pairs_split: str = "train") -> float:
  """δ = 1 / (2 n) for n the training PAIRS of `register_msmarco_dual_encoder`
  with the same arguments (the paper's δ; the trainer's default counts the
  rows, each a group of pairs). n counts the relevant qrels rows that parse,
  an upper bound on the pairs when the task skips malformed rows, so δ never
  exceeds 1 / (2 n_pairs)."""
  data_dir = DEFAULT_SAMPLE_DIR if data_dir is None else data_dir
  paths = _split_files(data_dir, train_pairs_split, train_pairs_dir)
  return 1.0 / (2 * len(_relevant_qrels(paths["qrels"], "skip")))


__all__ = [
    "DEFAULT_SAMPLE_DIR", "DEFAULT_VOCABULARY_PATH", "DEFAULT_TASK_NAME",
    "DUAL_ENCODER_TASK_NAME", "INPUT_PREFIX", "TASK_FEATURE_LENGTHS",
    "MalformedLineError", "read_tsv_pairs", "read_qrels",
    "load_query_passage_pairs", "load_collection_ids",
    "register_msmarco_query_generation", "register_msmarco_dual_encoder",
    "msmarco_dual_encoder_delta",
]
