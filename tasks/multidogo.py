"""The seqio LM tasks of the domain-privacy experiments ("Domain Private
Transformers for Multi-Domain Dialog Systems") on MultiDoGo dialogs, read,
split and formatted by `dpjax.data.readers.multidogo`.

Examples: each conversation of a split is tokenized on its own; as in the
paper ("concatenate all dialogs for a domain and chunk them by 1024 tokens"),
a domain's token sequences are concatenated and cut into `chunk_length`
pieces (`pack=True`), or each conversation is cut on its own (`pack=False`).
A chunk is one training example, so with packing one conversation can be in
two examples: DP is per chunk (group size 2 per conversation). Unpacked,
each chunk carries its conversation's id (`user_id`), and
`train.privacy_unit = 'user'` makes the conversation the unit of privacy.
The default `chunk_length` 1023 plus the BOS the GPT-2 feature converter
prepends is GPT-2's 1024-token context.

The redacted tasks apply a `dpjax.data.text.redaction.Policy` to every
utterance (all of the policy's domains) before formatting; control tokens
are never redacted.

The keyword policy is read here (`keywords_path`); the classifier policy
comes from the dialog pipeline, which owns the classifier
(`register_multidogo_tasks.classifier_policy`).

seqio/TF (also through `dpjax.data.vocabularies`) are imported when a task is
registered, so importing this module, for its gin configurables, does not
import TensorFlow.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Collection, Mapping, Sequence

import gin
import numpy as np

from dpjax.data.readers import malformed
from dpjax.data.readers.multidogo import (
    CONTROL_TOKENS,
    DEFAULT_BPE_MERGES_PATH,
    DEFAULT_BPE_VOCAB_PATH,
    DEFAULT_CHUNK_LENGTH,
    DEFAULT_DATA_DIR,
    DEFAULT_KEYWORDS_PATH,
    PAPER_DOMAINS,
    SPLITS,
    chunk_conversations,
    domain_path,
    format_conversation,
    load_split,
    redact_conversations,
)
from dpjax.data.text import redaction

# Unpacked tasks (`pack=False`) carry each chunk's conversation id here: the
# unit of user-level DP (`train.privacy_unit = 'user'`). MultiDoGo names no
# speaker, so a conversation is the user. Packed chunks mix conversations
# and have no owner.
USER_COLUMN = "user_id"

def dialog_vocabulary(vocab_path: str = DEFAULT_BPE_VOCAB_PATH,
                      merges_path: str = DEFAULT_BPE_MERGES_PATH):
  """GPT-2 byte-level BPE with `CONTROL_TOKENS` appended as extra tokens
  (ids `base_size ..`, never split). A pretrained GPT-2 embedding needs
  `len(CONTROL_TOKENS)` more rows."""
  from dpjax.data import vocabularies  # lazy: TensorFlow

  return vocabularies.ByteLevelBPEVocabulary(vocab_path, merges_path,
                                             extra_tokens=CONTROL_TOKENS)


def _chunks_dataset(chunks: list[np.ndarray], domains: list[str],
                    users: list[str] | None):
  import tensorflow as tf  # lazy: TensorFlow
  from dpjax.data import arrays  # lazy: TensorFlow

  features = {
      "inputs": tf.zeros([len(chunks), 0], tf.int32),
      "targets": arrays.ragged_rows(chunks),
      "domain": tf.constant(domains, tf.string, shape=[len(chunks)]),
  }
  if users is not None:
    features[USER_COLUMN] = tf.constant(users, tf.string, shape=[len(chunks)])
  return tf.data.Dataset.from_tensor_slices(features)


def register_multidogo_task(
    name: str, *,
    data_dir: str | None = None,
    domains: Sequence[str] = PAPER_DOMAINS,
    policy: Callable[[], redaction.Policy] | None = None,
    domain_tokens: bool = True,
    chunk_length: int = DEFAULT_CHUNK_LENGTH,
    pack: bool = True,
    split_seed: int = 0,
    train_conversations: Collection[str] | None = None,
    vocabulary=None,
    on_malformed: str = "fail"):
  """Registers (or re-registers) one decoder-only MultiDoGo LM task.

  Examples are token chunks (see the module docstring): `inputs` empty (no
  prompt), `targets` at most `chunk_length` ids with no EOS (the `<_eoc_>`
  token ends a conversation), plus a passthrough `domain` string. Splits
  "train", "validation" and "test". Set the task feature length of `targets`
  to at least `chunk_length`: longer chunks are trimmed by seqio.

  Files are read when a split is requested (registration only checks that
  they exist).

  Args:
    name: registry name; a task already registered under it is replaced.
    data_dir: MultiDoGo `unannotated/` directory; None means the sample.
    domains: the domains whose conversations the task holds.
    policy: None for the original text; else a zero-argument function making
      the redaction policy (called once, when a split is first read).
    domain_tokens: the `<DOMAIN>` token before each utterance.
    chunk_length, pack: the chunking.
    split_seed: seed of the 60/20/20 split.
    train_conversations: None for the whole train split; else the ids of the
      conversations it keeps (a membership experiment's shadow model trains
      on half of them). An id not in the train split is a ValueError when
      the split is read.
    vocabulary: a seqio vocabulary; None means `dialog_vocabulary()`.
    on_malformed: "fail" or "skip" (see `read_conversations`).

  Returns:
    The registered `seqio.Task`.
  """
  import seqio  # lazy: TensorFlow

  if isinstance(domains, str):
    raise TypeError("domains must be a sequence of names, not a str")
  if on_malformed not in malformed.ON_MALFORMED:
    raise ValueError(f"on_malformed must be 'fail' or 'skip', got {on_malformed!r}")
  if chunk_length < 1:
    raise ValueError(f"chunk_length must be >= 1, got {chunk_length}")
  data_dir = data_dir or DEFAULT_DATA_DIR
  domains = tuple(domains)
  for d in domains:
    domain_path(data_dir, d)  # fail fast on a wrong directory or domain
  vocabulary = vocabulary or dialog_vocabulary()
  make_policy = functools.cache(policy) if policy else None

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    conversations = load_split(split, data_dir, domains, seed=split_seed,
                               on_malformed=on_malformed)
    if split == "train" and train_conversations is not None:
      conversations = _kept(conversations, train_conversations)
    if make_policy:
      conversations = redact_conversations(conversations, make_policy())
    ids = [np.asarray(vocabulary.encode(format_conversation(
        c, domain_tokens=domain_tokens)), np.int32) for c in conversations]
    chunks, chunk_domains = chunk_conversations(
        ids, [c.domain for c in conversations], chunk_length, pack=pack)
    # Unpacked, each chunk belongs to one conversation: the user-level unit.
    users = None if pack else chunk_conversations(
        ids, [c.conversation_id for c in conversations], chunk_length,
        pack=False)[1]
    if shuffle_files:
      order = np.random.default_rng(seed).permutation(len(chunks))
      chunks, chunk_domains = [chunks[i] for i in order], [chunk_domains[i] for i in order]
      users = None if users is None else [users[i] for i in order]
    return _chunks_dataset(chunks, chunk_domains, users)

  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn=dataset_fn, splits=SPLITS),
      preprocessors=[],
      output_features={
          "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=False),
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=False),
      },
      metric_fns=[],
  )


def _kept(conversations, ids: Collection[str]) -> list:
  """The conversations whose id is in `ids`, which must all be there."""
  ids = set(ids)
  missing = ids - {c.conversation_id for c in conversations}
  if missing:
    raise ValueError(f"{len(missing)} of the {len(ids)} conversations to train "
                     f"on are not in the train split: {sorted(missing)[:5]}")
  return [c for c in conversations if c.conversation_id in ids]


def read_conversation_ids(path: str) -> list[str]:
  """Conversation ids, one per line (blank lines skipped)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"conversation id file not found: {path!r}")
  with open(path) as f:
    return [line.strip() for line in f if line.strip()]


@gin.configurable("register_multidogo_tasks")
@dataclasses.dataclass(frozen=True)
class MultidogoConfig:
  """The MultiDoGo tasks' settings, registered with gin as
  `register_multidogo_tasks` (so `register_multidogo_tasks.data_dir = ...`
  fills it): the tasks and the dialog pipeline that attacks them read the
  same typed record (see `register_multidogo_tasks` for the fields)."""
  data_dir: str | None = None
  domains: Sequence[str] = PAPER_DOMAINS
  domain_tokens: bool = True
  chunk_length: int = DEFAULT_CHUNK_LENGTH
  pack: bool = True
  keywords_path: str | None = None
  classifier_policy: Callable[[], redaction.Policy] | None = None
  bpe_vocab_path: str | None = None
  bpe_merges_path: str | None = None
  split_seed: int = 0
  on_malformed: str = "fail"
  train_conversations_path: str | None = None


def register_multidogo_tasks(
    config: MultidogoConfig | None = None,
    checkpoint_tokenizer_files: Mapping[str, str] | None = None,
) -> list:
  """Registers the MultiDoGo LM tasks (all over `domains`, unless named):

  * `multidogo_lm`: original text (the paper's Public / Private training);
  * `multidogo_lm_redacted_keyword`: utterances redacted by the keyword
    policy of `keywords_path` (Pub+Redacted; JFT / redaction-schedule);
  * `multidogo_lm_redacted_classifier`: redacted by `classifier_policy()`
    (registered only if `classifier_policy` is set);
  * `multidogo_lm_only_{domain}`: that domain alone (the DOMAIN_i Only
    baseline), and `multidogo_lm_without_{domain}`: the other domains (the
    reference model of D without d_j), `domain` lower case.

  Args (`config`, default `MultidogoConfig()` as gin configures it):
    data_dir: MultiDoGo `unannotated/` directory; None means the sample.
    domains: the pooled domains (default the paper's AIRLINE, MEDIA,
      INSURANCE).
    domain_tokens, chunk_length, pack, split_seed, on_malformed: see
      `register_multidogo_task`.
    train_conversations_path: None, or a file of conversation ids (one per
      line): every task's train split keeps those conversations only.
    keywords_path: JSON phrase lists `{"DOMAIN": [...]}`; None means the
      sample's `keywords.json`. Redaction uses every domain of the policy
      (keyword file or classifier), selected or not.
    classifier_policy: a zero-argument function making the classifier
      policy, called when a redacted split is first read; the dialog pipeline
      binds `@classifier_policy` (`dpjax.pipelines.dialog.classifier`), which loads a
      saved classifier.
    bpe_vocab_path, bpe_merges_path: GPT-2 `vocab.json` / `merges.txt`; None
      means the pretrained checkpoint's (`checkpoint_tokenizer_files`, passed
      by the trainer) if it has them, else the sample's. `CONTROL_TOKENS` are
      appended either way.
    checkpoint_tokenizer_files: `dpjax.pretrained.tokenizer_files` of the
      pretrained checkpoint, if any.

  Returns:
    The registered tasks.
  """
  from dpjax.data import vocabularies  # lazy: TensorFlow
  c = config or MultidogoConfig()
  vocabulary = dialog_vocabulary(*vocabularies.bpe_paths(
      c.bpe_vocab_path, c.bpe_merges_path, checkpoint_tokenizer_files,
      default_vocab=DEFAULT_BPE_VOCAB_PATH, default_merges=DEFAULT_BPE_MERGES_PATH))
  keywords_path = c.keywords_path or DEFAULT_KEYWORDS_PATH
  if not os.path.isfile(keywords_path):
    raise FileNotFoundError(f"keyword file not found: {keywords_path!r}")
  domains = tuple(c.domains)
  policies = {"": None, "_redacted_keyword": lambda: redaction.KeywordPolicy.from_json(
      keywords_path)}
  if c.classifier_policy:
    policies["_redacted_classifier"] = c.classifier_policy
  register = functools.partial(
      register_multidogo_task, data_dir=c.data_dir,
      domain_tokens=c.domain_tokens, chunk_length=c.chunk_length, pack=c.pack,
      split_seed=c.split_seed, vocabulary=vocabulary,
      on_malformed=c.on_malformed,
      train_conversations=(read_conversation_ids(c.train_conversations_path)
                           if c.train_conversations_path else None))
  registered = [register(f"multidogo_lm{suffix}", domains=domains, policy=policy)
                for suffix, policy in policies.items()]
  for d in domains:
    registered.append(register(f"multidogo_lm_only_{d.lower()}", domains=(d,)))
    if len(domains) > 1:
      registered.append(register(f"multidogo_lm_without_{d.lower()}",
                                 domains=tuple(x for x in domains if x != d)))
  return registered


__all__ = ["MultidogoConfig", "dialog_vocabulary", "register_multidogo_task",
           "register_multidogo_tasks"]
