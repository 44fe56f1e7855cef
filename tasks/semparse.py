"""The seqio tasks of the semantic-parsing experiments ("Privacy-Preserving
Domain Adaptation of Semantic Parsers") on SMCalFlow 2.0 and TreeDST.

The examples are the human turns read by `dpjax.data.readers.semparse` (one
`(user utterance, linearized program)` per kept turn, TreeDST turns with
their domain), in the portion and with the function filter a task asks for;
`KINDS` says which texts each task kind feeds a model.

seqio/TF are imported when a task is registered, so importing this module
(for its gin configurables) does not import TensorFlow.
"""
from __future__ import annotations

import dataclasses

import os
from typing import Mapping, Sequence

import gin
import numpy as np

from dpjax.data.readers import SAMPLE_DATA_DIR, malformed, semparse
from dpjax.data.readers.semparse import Turn

DEFAULT_VOCAB_DIR = os.path.join(SAMPLE_DATA_DIR, "semparse_vocab")
DEFAULT_BPE_VOCAB_PATH = os.path.join(DEFAULT_VOCAB_DIR, "vocab.json")
DEFAULT_BPE_MERGES_PATH = os.path.join(DEFAULT_VOCAB_DIR, "merges.txt")
DEFAULT_SENTENCEPIECE_PATH = os.path.join(DEFAULT_VOCAB_DIR,
                                          "semparse_sample.model")

# Task kind -> its example texts. Decoder-only kinds feed GPT-2 (prompt
# "inputs" + "targets"); "parser" feeds T5.
KINDS = {
    "utterance_lm": "1-stage: inputs '', targets utterance",
    "domain_to_utterance": "1.5-stage: inputs domain prompt, targets utterance",
    "parse_lm": "2-stage, stage 1: inputs '', targets linearized program",
    "parse_to_utterance": ("2-stage, stage 2: inputs program prompt, targets "
                           "utterance"),
    "parser": "T5 parser: inputs utterance, targets linearized program",
}
DATASET_KINDS = {
    "smcalflow": ("utterance_lm", "parse_lm", "parse_to_utterance", "parser"),
    "treedst": ("utterance_lm", "domain_to_utterance", "parse_lm",
                "parse_to_utterance", "parser"),
}


def domain_prompt(domain: str) -> str:
  """The 1.5-stage prompt; the generated utterance follows it."""
  return f"domain: {domain}\nutterance:"


def parse_prompt(program: str) -> str:
  """The 2-stage (parse -> utterance) prompt for a linearized program."""
  return f"parse: {program}\nutterance:"


def _texts(turn: Turn, kind: str) -> tuple[str, str]:
  """(inputs, targets) of one example of `kind`."""
  if kind == "utterance_lm":
    return "", turn.utterance
  if kind == "domain_to_utterance":
    return domain_prompt(turn.domain), turn.utterance
  if kind == "parse_lm":
    return "", turn.program
  if kind == "parse_to_utterance":
    return parse_prompt(turn.program), turn.utterance
  return turn.utterance, turn.program  # parser


def _examples_dataset(turns: list[Turn], kind: str, with_domain: bool):
  import tensorflow as tf  # lazy: TensorFlow

  n = len(turns)
  texts = [_texts(t, kind) for t in turns]
  features = {
      "inputs": tf.constant([i for i, _ in texts], tf.string, shape=[n]),
      "targets": tf.constant([t for _, t in texts], tf.string, shape=[n]),
      "dialogue_id": tf.constant([t.dialogue_id for t in turns], tf.string,
                                 shape=[n]),
      "turn_index": np.array([t.turn_index for t in turns], np.int64),
  }
  if with_domain:
    features["domain"] = tf.constant([t.domain for t in turns], tf.string,
                                     shape=[n])
  return tf.data.Dataset.from_tensor_slices(features)


def _bpe_vocabulary(vocab_path: str, merges_path: str):
  from dpjax.data import vocabularies  # lazy: TensorFlow

  return vocabularies.ByteLevelBPEVocabulary(vocab_path, merges_path)


def _sentencepiece_vocabulary(path: str):
  import seqio  # lazy: TensorFlow
  import tensorflow as tf  # lazy: TensorFlow

  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f"SentencePiece model not found: {path!r}")
  return seqio.SentencePieceVocabulary(path)


def register_semparse_task(name: str, dataset: str, kind: str, *,
                           data_dir: str | None = None,
                           vocabulary=None,
                           portion: str = "all",
                           exclude_functions: Sequence[str] = (),
                           split_seed: int = 0,
                           public_fraction: float = semparse.PUBLIC_FRACTION,
                           on_malformed: str = "fail"):
  """Registers (or re-registers) one semantic-parsing seqio Task.

  Examples (one per human turn, see the module docstring) have the text
  features of `KINDS[kind]`, plus passthrough `dialogue_id` (string),
  `turn_index` (int64) and, for TreeDST, `domain` (string). Splits "train"
  and "validation". Preprocessing: tokenize, then EOS after trimming where
  the feature adds one. Decoder-only kinds: `inputs` add no EOS (the prompt,
  possibly empty), `targets` do; the model's feature converter prepends BOS
  and masks the prompt out of the loss. "parser": both features end in EOS.

  Files are read when a dataset is requested (registration only checks that
  they exist), so registering costs nothing for runs that use other tasks.

  Args:
    name: registry name; a task already registered under it is replaced.
    dataset: "smcalflow" or "treedst".
    kind: a key of `DATASET_KINDS[dataset]`.
    data_dir: the dataset directory; None means the embedded sample.
    vocabulary: a seqio vocabulary; None means the embedded sample's GPT-2
      BPE (decoder-only kinds) or SentencePiece model ("parser").
    portion: "all", "public" or "private" (see the module docstring); the
      same portion is taken of both splits, so "public" validation is the
      paper's 1/10 test subsample.
    exclude_functions: drop from the TRAIN split every example whose program
      calls a function matching one of these (`drop_functions`), e.g. the
      paper's D_pub without Weather; validation keeps them, so the missing
      functionality can be measured.
    split_seed: seed of the public/private split.
    public_fraction: size of the public portion.
    on_malformed: "fail" or "skip" (see `read_turns`).

  Returns:
    The registered `seqio.Task`.
  """
  import seqio  # lazy: TensorFlow

  if dataset not in semparse.DATASETS:
    raise ValueError(f"dataset must be one of {semparse.DATASETS}, got {dataset!r}")
  if kind not in DATASET_KINDS[dataset]:
    raise ValueError(f"{dataset} has task kinds {DATASET_KINDS[dataset]}, "
                     f"got {kind!r}")
  if portion not in semparse.PORTIONS:
    raise ValueError(f"portion must be one of {semparse.PORTIONS}, got {portion!r}")
  if on_malformed not in malformed.ON_MALFORMED:
    raise ValueError(f"on_malformed must be 'fail' or 'skip', got {on_malformed!r}")
  data_dir = data_dir or semparse.DEFAULT_DATA_DIRS[dataset]
  splits = tuple(semparse.SPLIT_FILES)
  for split in splits:
    semparse.split_path(data_dir, split)  # fail fast on a wrong directory
  if isinstance(exclude_functions, str):
    raise TypeError("exclude_functions must be a sequence of names, not a str")
  exclude = tuple(exclude_functions)
  if vocabulary is None:
    vocabulary = (_sentencepiece_vocabulary(DEFAULT_SENTENCEPIECE_PATH)
                  if kind == "parser" else
                  _bpe_vocabulary(DEFAULT_BPE_VOCAB_PATH, DEFAULT_BPE_MERGES_PATH))

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    turns = semparse.select_portion(
        semparse.load_turns(dataset, split, data_dir, on_malformed=on_malformed),
        portion, seed=split_seed, public_fraction=public_fraction)
    if split == "train" and exclude:
      turns = semparse.drop_functions(turns, exclude)
    if shuffle_files:
      turns = [turns[i] for i in np.random.default_rng(seed).permutation(len(turns))]
    return _examples_dataset(turns, kind, with_domain=dataset == "treedst")

  decoder_only = kind != "parser"
  output_features = {
      "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=not decoder_only,
                              required=True),
      "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True,
                               required=True),
  }
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn=dataset_fn, splits=splits),
      preprocessors=[
          seqio.preprocessors.tokenize,
          seqio.preprocessors.append_eos_after_trim,
      ],
      output_features=output_features,
      metric_fns=[],
  )


@gin.configurable("register_semparse_tasks")
@dataclasses.dataclass(frozen=True)
class SemparseConfig:
  """The semparse tasks' settings, registered with gin as
  `register_semparse_tasks` (so `register_semparse_tasks.treedst_dir = ...`
  fills it): the tasks and the pipeline that plans on their data read the
  same typed record (see `register_semparse_tasks` for the fields)."""
  smcalflow_dir: str | None = None
  treedst_dir: str | None = None
  bpe_vocab_path: str | None = None
  bpe_merges_path: str | None = None
  sentencepiece_path: str | None = None
  lm_portion: str = "all"
  parser_portion: str = "all"
  parser_exclude_functions: Sequence[str] = ()
  split_seed: int = 0
  public_fraction: float = semparse.PUBLIC_FRACTION
  on_malformed: str = "fail"

  def data_dir(self, dataset: str) -> str | None:
    """`dataset`'s directory; None: the embedded sample."""
    return {"smcalflow": self.smcalflow_dir, "treedst": self.treedst_dir
            }[dataset]


def register_semparse_tasks(
    config: SemparseConfig | None = None,
    checkpoint_tokenizer_files: Mapping[str, str] | None = None,
) -> list:
  """Registers `{dataset}_{kind}` for every kind of `DATASET_KINDS`.

  That is `smcalflow_utterance_lm`, `smcalflow_parse_lm`,
  `smcalflow_parse_to_utterance`, `smcalflow_parser`, and the same for
  `treedst_` plus `treedst_domain_to_utterance`. For other combinations
  (e.g. a public parser without Weather next to the full one) call
  `register_semparse_task` with a name of your own.

  Args (`config`, default `SemparseConfig()` as gin configures it):
    smcalflow_dir, treedst_dir: dataset directories; None means the embedded
      samples.
    bpe_vocab_path, bpe_merges_path: GPT-2 `vocab.json` / `merges.txt` of the
      decoder-only tasks; None means the pretrained checkpoint's
      (`checkpoint_tokenizer_files`, passed by the trainer) if it has them,
      else the embedded sample's.
    sentencepiece_path: SentencePiece model of the parser tasks (pad 0, eos 1);
      None means the checkpoint's `spiece.model` if any, else the sample's.
    lm_portion: portion of the decoder-only (generation) tasks.
    parser_portion, parser_exclude_functions: portion and train-split
      function filter of the parser tasks.
    split_seed, public_fraction, on_malformed: see `register_semparse_task`.
    checkpoint_tokenizer_files: `dpjax.pretrained.tokenizer_files` of the
      pretrained checkpoint, if any.

  Returns:
    The registered tasks.
  """
  from dpjax.data import vocabularies  # lazy: TensorFlow
  c = config or SemparseConfig()
  files = dict(checkpoint_tokenizer_files or {})
  bpe = _bpe_vocabulary(*vocabularies.bpe_paths(
      c.bpe_vocab_path, c.bpe_merges_path, files,
      default_vocab=DEFAULT_BPE_VOCAB_PATH, default_merges=DEFAULT_BPE_MERGES_PATH))
  spm = _sentencepiece_vocabulary(c.sentencepiece_path or files.get(
      "sentencepiece") or DEFAULT_SENTENCEPIECE_PATH)
  registered = []
  for dataset, kinds in DATASET_KINDS.items():
    for kind in kinds:
      parser = kind == "parser"
      registered.append(register_semparse_task(
          f"{dataset}_{kind}", dataset, kind, data_dir=c.data_dir(dataset),
          vocabulary=spm if parser else bpe,
          portion=c.parser_portion if parser else c.lm_portion,
          exclude_functions=c.parser_exclude_functions if parser else (),
          split_seed=c.split_seed, public_fraction=c.public_fraction,
          on_malformed=c.on_malformed))
  return registered


__all__ = [
    "DEFAULT_VOCAB_DIR", "DEFAULT_BPE_VOCAB_PATH", "DEFAULT_BPE_MERGES_PATH",
    "DEFAULT_SENTENCEPIECE_PATH", "KINDS", "DATASET_KINDS", "domain_prompt",
    "parse_prompt", "register_semparse_task", "register_semparse_tasks",
    "SemparseConfig",
]
