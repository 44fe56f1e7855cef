"""The pretraining task of `python -m dpjax.pretrain`: a public text corpus
as T5 span corruption or GPT-2 causal language modelling.

One gin-configured registration, `register_pretraining_task`, makes the task
the pretraining gin files name (gin/pretrain/*.gin):

* `objective = 'span_corruption'` (T5): each document is tokenized with the
  SentencePiece model, cut into segments of `segment_length` tokens, and each
  segment corrupted `copies` times (`dpjax.data.span_corruption`: 15% noise
  in runs of mean length 3, sentinels `<extra_id_i>` the vocabulary's last
  `extra_ids` ids). `inputs` is the corrupted segment, `targets` the hidden
  runs, both + EOS. The model's vocab_size must count the extra ids.
* `objective = 'causal_lm'` (GPT-2): documents tokenized with the byte-level
  BPE, each followed by EOS, concatenated and cut into chunks of
  `chunk_length` tokens (GPT-2's packing); `inputs` empty, `targets` a chunk.

Every mask is drawn from `np.random.default_rng([seed, copy, document,
segment])`, so a corpus gives the same examples on every machine; the
trainer's public steps then shuffle them with `train.seed`. The corpus is
`dpjax.data.readers.text_corpus` JSON Lines; the embedded public corpora and the
sample tokenizers are gin constants (`%tasks.MSMARCO_PUBLIC`,
`%tasks.MSMARCO_SPM`, ...), so gin files name them without a path.
"""
from __future__ import annotations

import functools
import os
from typing import Mapping, NamedTuple

import gin
import numpy as np

from dpjax.data import span_corruption
from dpjax.data.readers import SAMPLE_DATA_DIR, text_corpus
from dpjax.pretrained import hf

OBJECTIVES = ("span_corruption", "causal_lm")

# The embedded public corpora (`python -m tasks.<world>_sample.generate
# --public_corpus`), the sample tokenizers they are read with, and the
# shipped checkpoints pretrained on them, under tasks/data/.
PATHS = {
    "MSMARCO_PUBLIC": "msmarco_public",
    "MULTIDOGO_PUBLIC": "multidogo_public",
    "TEXTCLS_PUBLIC": "textcls_public",
    "SEQPATE_PUBLIC": "seqpate_public",
    "SEMPARSE_PUBLIC": "semparse_public",
    "MSMARCO_SPM": "msmarco_sample/spm/msmarco_sample.model",
    "SEMPARSE_SPM": "semparse_vocab/semparse_sample.model",
    "SEMPARSE_BPE": "semparse_vocab",
    "MULTIDOGO_BPE": "multidogo_sample/bpe",
    "TEXTCLS_BPE": "textcls_sample/bpe",
    "SEQPATE_BPE": "seqpate_sample/vocab",
    # The checkpoints `python -m dpjax.pretrain` made from them (gin/pretrain).
    "PRETRAINED_MSMARCO_T5": "pretrained/msmarco_t5",
    "PRETRAINED_SEMPARSE_T5": "pretrained/semparse_t5",
    "PRETRAINED_SEMPARSE_GPT2": "pretrained/semparse_gpt2",
    "PRETRAINED_MULTIDOGO_GPT2": "pretrained/multidogo_gpt2",
    "PRETRAINED_TEXTCLS_GPT2": "pretrained/textcls_gpt2",
    "PRETRAINED_SEQPATE_GPT2": "pretrained/seqpate_gpt2",
}
PATHS_ABS = {name: os.path.join(SAMPLE_DATA_DIR, path)
             for name, path in PATHS.items()}
for _name, _path in PATHS_ABS.items():
  gin.constant(f"tasks.{_name}", _path)


class Source(NamedTuple):
  """Where a registered pretraining task reads from: its corpus directory
  and tokenizer files (the release carries both's identity)."""
  corpus_dir: str
  tokenizer_files: dict


# Task name -> its Source, as registered (beside seqio's TaskRegistry).
SOURCES: dict[str, Source] = {}


def tokenizer_files(tokenizer: str) -> dict[str, str]:
  """`{'sentencepiece': .model}` for a SentencePiece model file, `{'vocab':
  vocab.json, 'merges': merges.txt}` for a directory holding GPT-2's BPE
  files: the form `dpjax.pretrained.tokenizer_files` gives (and, for a
  directory, what it reads), which the export copies beside the weights."""
  if os.path.isfile(tokenizer) and tokenizer.endswith(".model"):
    return {"sentencepiece": tokenizer}
  if os.path.isdir(tokenizer):
    files = hf.tokenizer_files(tokenizer)
    if "vocab" in files:
      return files
  raise FileNotFoundError(
      f"tokenizer {tokenizer!r}: expected a SentencePiece .model file or a "
      "directory with vocab.json and merges.txt")


def span_corruption_examples(documents: list[list[int]], *, vocab_size: int,
                             segment_length: int, noise_density: float,
                             mean_noise_span_length: float, copies: int,
                             seed: int) -> tuple[list, list]:
  """(inputs, targets) token lists, copy-major then document order."""
  inputs, targets = [], []
  for copy in range(copies):
    for d, tokens in enumerate(documents):
      tokens = np.asarray(tokens, np.int32)
      for s, start in enumerate(range(0, len(tokens), segment_length)):
        segment = tokens[start:start + segment_length]
        if len(segment) < 2:
          continue
        rng = np.random.default_rng([seed, copy, d, s])
        mask = span_corruption.noise_mask(len(segment), noise_density,
                                          mean_noise_span_length, rng)
        x, y = span_corruption.corrupt(segment, mask, vocab_size)
        inputs.append(x)
        targets.append(y)
  return inputs, targets


def causal_lm_chunks(documents: list[list[int]], *, eos_id: int,
                     chunk_length: int) -> list[np.ndarray]:
  """The documents, each + EOS, concatenated and cut every `chunk_length`."""
  stream = np.concatenate([np.append(np.asarray(d, np.int32), eos_id)
                           for d in documents])
  return [stream[i:i + chunk_length]
          for i in range(0, len(stream), chunk_length)]


@gin.configurable
def register_pretraining_task(
    name: str | None = None,
    objective: str = "span_corruption",
    corpus_dir: str | None = None,
    tokenizer: str | None = None,
    extra_ids: int = 100,
    segment_length: int = 128,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    copies: int = 1,
    chunk_length: int = 128,
    seed: int = 0,
    max_documents: int | None = None,
    on_malformed: str = "fail"):
  """Registers (replacing) the pretraining task `name`; None: registers
  nothing and returns None.

  Args:
    name: the task's registry name (the pretraining gin's
      MIXTURE_OR_TASK_NAME).
    objective: 'span_corruption' (T5) or 'causal_lm' (GPT-2).
    corpus_dir: a `text_corpus` directory (train.jsonl, validation.jsonl).
    tokenizer: a SentencePiece .model (span corruption) or a directory with
      GPT-2's vocab.json + merges.txt (causal LM).
    extra_ids: span corruption's sentinels, appended to the SentencePiece
      vocabulary (T5: 100).
    segment_length, noise_density, mean_noise_span_length, copies: span
      corruption (module docstring); `copies` masks of each train segment
      (validation: one).
    chunk_length: causal LM tokens per example.
    seed: the masks' seed (public: this is public data).
    max_documents: the first this many documents of each split (None: all);
      a cut-down corpus for tests.
    on_malformed: 'fail' or 'skip' (`text_corpus.read_documents`).
  """
  if name is None:
    return None
  import seqio  # lazy: TensorFlow
  from dpjax.data import vocabularies  # lazy: TensorFlow

  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
  if not corpus_dir or not tokenizer:
    raise ValueError("register_pretraining_task needs corpus_dir and tokenizer")
  for split in text_corpus.SPLITS:
    path = text_corpus.split_path(corpus_dir, split)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"corpus file not found: {path!r}")
  files = tokenizer_files(tokenizer)
  span = objective == "span_corruption"
  if span and "sentencepiece" not in files:
    raise ValueError(f"span corruption needs a SentencePiece model, got "
                     f"{tokenizer!r}")
  if not span and "vocab" not in files:
    raise ValueError(f"causal LM needs GPT-2 BPE files, got {tokenizer!r}")
  vocabulary = vocabularies.vocabulary_from_files(
      files, **({"extra_ids": extra_ids} if span else {}))

  @functools.lru_cache(maxsize=None)
  def examples(split: str) -> Mapping[str, list]:
    documents = text_corpus.read_documents(
        text_corpus.split_path(corpus_dir, split), on_malformed)
    documents = [vocabulary.encode(d) for d in documents[:max_documents]]
    if objective == "causal_lm":
      chunks = causal_lm_chunks(documents, eos_id=vocabulary.eos_id,
                                chunk_length=chunk_length)
      return {"inputs": [np.zeros([0], np.int32)] * len(chunks),
              "targets": chunks}
    inputs, targets = span_corruption_examples(
        documents, vocab_size=vocabulary.vocab_size,
        segment_length=segment_length, noise_density=noise_density,
        mean_noise_span_length=mean_noise_span_length,
        copies=copies if split == "train" else 1, seed=seed)
    return {"inputs": inputs, "targets": targets}

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    import tensorflow as tf  # lazy: TensorFlow
    from dpjax.data import arrays  # lazy: TensorFlow

    del shuffle_files, seed  # the trainer samples; order here is fixed
    return tf.data.Dataset.from_tensor_slices(
        {k: arrays.ragged_rows(v) for k, v in examples(split).items()})

  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  SOURCES[name] = Source(os.path.abspath(corpus_dir), files)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn=dataset_fn,
                                      splits=text_corpus.SPLITS),
      preprocessors=[seqio.preprocessors.append_eos_after_trim] if span else [],
      output_features={
          "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=span),
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=span)},
      metric_fns=[])
