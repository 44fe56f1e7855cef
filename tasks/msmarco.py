"""The seqio tasks of MSMARCO passage ranking (readers: `dpjax.data.readers.msmarco`).

Data layer only: this module (like everything under `tasks/` and
`dpjax/data/`) may import TensorFlow and seqio. The DP core -- `dpjax.privacy`,
`dpjax.models` and the train step -- never does; it receives numpy arrays
(see `dpjax.data.arrays`).

Two tasks, one example per relevant (query, passage) pair:

* `register_msmarco_query_generation`: the paper's document -> query
  generation task: inputs `"generate_query: " + passage`, targets the query.
* `register_msmarco_dual_encoder`: the retrieval pairs (features `queries`
  and `documents`, no prefix) for the dual encoder. Its training pairs may
  come from another directory and file split than the collection, e.g. the
  `queries.synthetic.tsv` / `qrels.synthetic.tsv` written by
  `dpjax.generation.inference.generate_synthetic`, whose pids refer to the original
  `collection.tsv`.
"""
from __future__ import annotations

import functools
import os

import gin
import numpy as np

from dpjax.data.readers import malformed, msmarco

DEFAULT_SAMPLE_DIR = msmarco.DEFAULT_SAMPLE_DIR  # the registrations' default
DEFAULT_VOCABULARY_PATH = os.path.join(
    DEFAULT_SAMPLE_DIR, "spm", "msmarco_sample.model"
)
DEFAULT_TASK_NAME = "msmarco_query_generation"
DUAL_ENCODER_TASK_NAME = "msmarco_dual_encoder"
INPUT_PREFIX = "generate_query: "
# Maximum token lengths used in the paper: 384 for documents, 128 for queries.
TASK_FEATURE_LENGTHS = {"inputs": 384, "targets": 128}


def _examples_dataset(pairs: list[tuple[int, int, str, str]],
                      query_key: str, passage_key: str, passage_prefix: str):
  """A tf.data.Dataset of {query_key, passage_key, 'qid', 'pid'} from pairs."""
  import tensorflow as tf  # lazy: TensorFlow

  return tf.data.Dataset.from_tensor_slices({
      passage_key: tf.constant([passage_prefix + p for _, _, _, p in pairs],
                               dtype=tf.string, shape=[len(pairs)]),
      query_key: tf.constant([q for _, _, q, _ in pairs], dtype=tf.string,
                             shape=[len(pairs)]),
      "qid": np.array([qid for qid, _, _, _ in pairs], dtype=np.int64),
      "pid": np.array([pid for _, pid, _, _ in pairs], dtype=np.int64),
  })


def _relevant_count(path: str, on_malformed: str) -> int:
  """The relevant rows of the qrels file at `path`, counted once per version
  of the file (its size, inode and modification time): every training run
  registers the tasks again, and reading the qrels was most of that."""
  stat = os.stat(path)
  return _counted_relevant(path, on_malformed, stat.st_size, stat.st_ino,
                           stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _counted_relevant(path: str, on_malformed: str, *version: int) -> int:
  return len(msmarco.relevant_qrels(path, on_malformed))


def _register_pairs_task(task_name: str, files: dict[str, tuple],
                         vocabulary_path: str, on_malformed: str, *,
                         query_key: str, passage_key: str,
                         passage_prefix: str = ""):
  """Registers (replacing) a seqio Task of (query, passage) pairs.

  `files`: seqio split -> `(data_dir, msmarco split, pairs_dir)` as taken by
  `load_query_passage_pairs`. Both text features are tokenized and get EOS
  appended after trimming; `qid` and `pid` pass through.
  """
  import seqio  # lazy: TensorFlow
  import tensorflow as tf  # lazy: TensorFlow

  if on_malformed not in malformed.ON_MALFORMED:
    raise ValueError(
        f"on_malformed must be one of {malformed.ON_MALFORMED}, got {on_malformed!r}")
  # Fail fast on a wrong directory, and count the examples from the (small)
  # qrels files: exact unless rows get skipped as malformed.
  num_input_examples = {
      split: _relevant_count(msmarco.split_files(*where)["qrels"], on_malformed)
      for split, where in files.items()
  }
  if not tf.io.gfile.exists(vocabulary_path):
    raise FileNotFoundError(
        f"SentencePiece model not found: {vocabulary_path!r}")

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    data_dir, name, pairs_dir = files[split]
    pairs = msmarco.load_query_passage_pairs(data_dir, name, on_malformed=on_malformed,
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
  paths = msmarco.split_files(data_dir, train_pairs_split, train_pairs_dir)
  return 1.0 / (2 * len(msmarco.relevant_qrels(paths["qrels"], "skip")))


__all__ = [
    "DEFAULT_SAMPLE_DIR", "DEFAULT_VOCABULARY_PATH", "DEFAULT_TASK_NAME",
    "DUAL_ENCODER_TASK_NAME", "INPUT_PREFIX", "TASK_FEATURE_LENGTHS",
    "register_msmarco_query_generation", "register_msmarco_dual_encoder",
    "msmarco_dual_encoder_delta",
]
