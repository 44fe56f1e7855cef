"""MultiDoGo dialog readers and the seqio LM tasks of the domain-privacy
experiments ("Domain Private Transformers for Multi-Domain Dialog Systems").

Files: the unannotated conversations of the MultiDoGo release
(awslabs/multi-domain-goal-oriented-dialogues-dataset, `data/unannotated/`),
one file per domain, `{domain}.tsv` with `domain` lower case (`airline.tsv`,
`media.tsv`, `insurance.tsv`, `fastfood.tsv`, `finance.tsv`,
`software.tsv`). The release's README describes them as TSV with columns
`conversationId, turnNumber, utteranceId, utterance, authorRole`; the
published files are in fact comma-separated with quoting (readers of the
release parse them with `,`), and utterances may hold newlines inside
quotes. The reader takes the delimiter from the header line (a tab if it has
one, else a comma), finds the columns by name (others are ignored) and
parses quoting with Python's `csv`. Rows are one utterance each; a
conversation's rows need not be contiguous and are ordered by `turnNumber`
(ties keep file order). `authorRole` is "customer" (-> `USR:`) or "agent"
(-> `SYS:`); "bot" rows (scripted system turns) also become `SYS:`. Text is
whitespace-normalised; a whitespace-only utterance is dropped.

Formatting (paper Appendix C): a conversation becomes one line,

    <_soc_> <AIRLINE> SYS: Hello! ... <AIRLINE> USR: I want ... <_eoc_>

with the domain token before every utterance, or, with `domain_tokens`
off (the paper's ablation, Sec. E.3), `<_soc_> SYS: ... USR: ... <_eoc_>`.

Splits (Sec. 6.2): per domain, conversations sorted by id are permuted with
`numpy.random.default_rng([seed, DOMAINS.index(domain)])`; the first
round(0.6 n) are "train", the next round(0.2 n) "validation", the rest
"test"; the domains' splits are then pooled. A domain's split depends only on
its file, the seed and the fractions: not on file order, nor on which other
domains are selected.

Examples: each conversation of a split is tokenized on its own; as in the
paper ("concatenate all dialogs for a domain and chunk them by 1024 tokens"),
a domain's token sequences are concatenated and cut into `chunk_length`
pieces (`pack=True`), or each conversation is cut on its own (`pack=False`).
A chunk is one training example, so with packing one conversation can be in
two examples: DP is per chunk (group size 2 per conversation). The default
`chunk_length` 1023 plus the BOS the GPT-2 feature converter prepends is
GPT-2's 1024-token context.

The redacted tasks apply a `dpjax.dialog.redaction.Policy` to every
utterance (all of the policy's domains) before formatting; control tokens
are never redacted.

Readers are pure Python (no TensorFlow); seqio/TF are imported when a task is
registered.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import os
import re
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import gin
import numpy as np

from dpjax.dialog import redaction
from tasks import malformed
from tasks.malformed import MalformedLineError  # noqa: F401  (re-exported)

_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_DATA_DIR = os.path.join(_DATA_DIR, "multidogo_sample")
DEFAULT_KEYWORDS_PATH = os.path.join(DEFAULT_DATA_DIR, "keywords.json")
DEFAULT_BPE_VOCAB_PATH = os.path.join(DEFAULT_DATA_DIR, "bpe", "vocab.json")
DEFAULT_BPE_MERGES_PATH = os.path.join(DEFAULT_DATA_DIR, "bpe", "merges.txt")

DOMAINS = ("AIRLINE", "FASTFOOD", "FINANCE", "INSURANCE", "MEDIA", "SOFTWARE")
PAPER_DOMAINS = ("AIRLINE", "MEDIA", "INSURANCE")
CONVERSATION_START = "<_soc_>"
CONVERSATION_END = "<_eoc_>"
ROLE_TOKENS = {"customer": "USR:", "agent": "SYS:", "bot": "SYS:"}
# Appended to the BPE vocabulary as extra tokens (never split), in this order.
CONTROL_TOKENS = (CONVERSATION_START, CONVERSATION_END, redaction.REDACTED,
                  "SYS:", "USR:", *(f"<{d}>" for d in DOMAINS))
REQUIRED_COLUMNS = ("conversationId", "turnNumber", "utterance", "authorRole")
SPLITS = ("train", "validation", "test")
SPLIT_FRACTIONS = (0.6, 0.2, 0.2)
DEFAULT_CHUNK_LENGTH = 1023
_TURN_NUMBER = re.compile(r"\d+(\.0*)?")


@dataclasses.dataclass(frozen=True)
class Utterance:
  turn_number: int
  role: str  # a key of ROLE_TOKENS
  text: str  # whitespace-normalised, non-empty


@dataclasses.dataclass(frozen=True)
class Conversation:
  domain: str
  conversation_id: str
  utterances: tuple[Utterance, ...]  # by turn number


def domain_token(domain: str) -> str:
  return f"<{domain}>"


def domain_path(data_dir: str, domain: str) -> str:
  """The file of `domain` in a MultiDoGo `unannotated/` directory."""
  if domain not in DOMAINS:
    raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
  path = os.path.join(data_dir, f"{domain.lower()}.tsv")
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"MultiDoGo file not found: {path!r} (a data directory holds "
        f"<domain>.tsv files, e.g. airline.tsv)")
  return path


def _decoded_lines(path: str, policy, bad_lines: set[int]) -> Iterator[str]:
  """The file's lines as text; an undecodable line is reported (and, when
  skipping, decoded with replacement characters and noted in `bad_lines`)."""
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        yield raw.decode("utf-8")
      except UnicodeDecodeError as e:
        policy(path, lineno, f"invalid UTF-8 ({e.reason})")
        bad_lines.add(lineno)
        yield raw.decode("utf-8", errors="replace")


def _utterance(row: dict[str, str]) -> tuple[str, int, str, str]:
  """(conversation id, turn number, role, text); ValueError says what is wrong."""
  conversation_id = row["conversationId"].strip()
  if not conversation_id:
    raise ValueError("empty conversationId")
  turn = row["turnNumber"].strip()
  if not _TURN_NUMBER.fullmatch(turn):
    raise ValueError(f"turnNumber must be a non-negative integer, got {turn!r}")
  role = row["authorRole"].strip()
  if role not in ROLE_TOKENS:
    raise ValueError(f"authorRole must be one of {sorted(ROLE_TOKENS)}, got {role!r}")
  return conversation_id, int(turn.split(".")[0]), role, " ".join(row["utterance"].split())


def read_conversations(path: str, domain: str, *, on_malformed: str = "fail"
                       ) -> list[Conversation]:
  """The conversations of one MultiDoGo domain file (see the module docstring).

  Args:
    path: a `{domain}.tsv` file of the release's `unannotated/` directory.
    domain: its domain, one of `DOMAINS`.
    on_malformed: "fail" raises `MalformedLineError("path:line: reason")` for a
      record that is not UTF-8, has other than the header's column count,
      broken quoting, an empty `conversationId`, a `turnNumber` that is not
      a non-negative integer (or "3.0"), or an unknown `authorRole`; "skip"
      drops such records and logs one warning with the count and the first
      location. A header without the required columns always raises.

  Returns:
    Conversations sorted by id; utterances by turn number.
  """
  if domain not in DOMAINS:
    raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
  policy = malformed.MalformedPolicy(on_malformed, f"rows in {path}")
  bad_lines: set[int] = set()
  rows: dict[str, list[tuple[int, int, str, str]]] = {}
  lines = _decoded_lines(path, policy, bad_lines)
  try:
    header_line = next(lines, "").lstrip("\ufeff")
    delimiter = "\t" if "\t" in header_line else ","
    header = next(csv.reader([header_line], delimiter=delimiter), [])
    header = [h.strip() for h in header]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
      raise MalformedLineError(path, 1, f"header lacks columns {missing} (found "
                               f"{header}; expected {', '.join(REQUIRED_COLUMNS)})")
    reader = csv.reader(lines, delimiter=delimiter, strict=True)
    reader_line = 1  # physical lines consumed so far
    while True:
      start = reader_line + 1
      try:
        record = next(reader, None)
      except csv.Error as e:
        reader_line = reader.line_num + 1
        policy(path, start, f"malformed CSV ({e})")
        continue
      if record is None:
        break
      reader_line = reader.line_num + 1
      if (not any(f.strip() for f in record)
          or bad_lines.intersection(range(start, reader_line + 1))):
        continue  # a blank line, or one already reported as bad UTF-8
      try:
        if len(record) != len(header):
          raise ValueError(f"expected {len(header)} columns, got {len(record)}")
        cid, turn, role, text = _utterance(dict(zip(header, record)))
      except ValueError as e:
        policy(path, start, str(e))
        continue
      if text:
        utterances = rows.setdefault(cid, [])
        utterances.append((turn, len(utterances), role, text))  # ties: file order
  finally:
    policy.report()
  return [Conversation(domain, cid, tuple(Utterance(t, r, x)
                                          for t, _, r, x in sorted(rows[cid])))
          for cid in sorted(rows)]


def load_conversations(data_dir: str | None = None,
                       domains: Sequence[str] = PAPER_DOMAINS, *,
                       on_malformed: str = "fail") -> list[Conversation]:
  """All conversations of `domains` (in that order); None: the sample."""
  if isinstance(domains, str):
    raise TypeError("domains must be a sequence of names, not a str")
  data_dir = data_dir or DEFAULT_DATA_DIR
  return [c for d in domains
          for c in read_conversations(domain_path(data_dir, d), d,
                                      on_malformed=on_malformed)]


def split_conversations(conversations: Iterable[Conversation], split: str, *,
                        seed: int = 0,
                        fractions: Sequence[float] = SPLIT_FRACTIONS
                        ) -> list[Conversation]:
  """The conversations of `split` (see the module docstring), by domain in
  order of first appearance, then by id."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if len(fractions) != 3 or min(fractions) < 0 or not math.isclose(sum(fractions), 1):
    raise ValueError(f"fractions must be 3 non-negative numbers summing to 1, "
                     f"got {fractions}")
  by_domain: dict[str, list[Conversation]] = {}
  for c in conversations:
    by_domain.setdefault(c.domain, []).append(c)
  out = []
  for domain, convs in by_domain.items():
    convs = sorted(convs, key=lambda c: c.conversation_id)
    n = len(convs)
    n_train = math.floor(fractions[0] * n + 0.5)
    n_valid = min(math.floor(fractions[1] * n + 0.5), n - n_train)
    bounds = {"train": (0, n_train), "validation": (n_train, n_train + n_valid),
              "test": (n_train + n_valid, n)}[split]
    order = np.random.default_rng([seed, DOMAINS.index(domain)]).permutation(n)
    out += [convs[i] for i in sorted(order[bounds[0]:bounds[1]])]
  return out


def load_split(split: str, data_dir: str | None = None,
               domains: Sequence[str] = PAPER_DOMAINS, *, seed: int = 0,
               on_malformed: str = "fail") -> list[Conversation]:
  """`split_conversations(load_conversations(...), split)`."""
  return split_conversations(load_conversations(data_dir, domains,
                                                on_malformed=on_malformed),
                             split, seed=seed)


def utterance_texts(conversations: Iterable[Conversation]) -> dict[str, list[str]]:
  """{domain: utterance texts}, domains in order of first appearance (the
  classifier policy's training data)."""
  out: dict[str, list[str]] = {}
  for c in conversations:
    out.setdefault(c.domain, []).extend(u.text for u in c.utterances)
  return out


def redact_conversations(conversations: Sequence[Conversation],
                         policy: redaction.Policy) -> list[Conversation]:
  """The conversations with every utterance redacted by `policy` (all its
  domains), in one batched call."""
  texts = policy.redact_batch([u.text for c in conversations for u in c.utterances])
  it = iter(texts)
  return [dataclasses.replace(c, utterances=tuple(
      dataclasses.replace(u, text=next(it)) for u in c.utterances))
          for c in conversations]


def format_conversation(conversation: Conversation, *,
                        domain_tokens: bool = True) -> str:
  """`<_soc_> <DOMAIN> SYS: ... <DOMAIN> USR: ... <_eoc_>` (see the module
  docstring)."""
  prefix = f"{domain_token(conversation.domain)} " if domain_tokens else ""
  turns = [f"{prefix}{ROLE_TOKENS[u.role]} {u.text}" for u in conversation.utterances]
  return " ".join([CONVERSATION_START, *turns, CONVERSATION_END])


def chunk_ids(ids: np.ndarray, length: int) -> list[np.ndarray]:
  """Consecutive pieces of `length` tokens; the last may be shorter."""
  if length < 1:
    raise ValueError(f"chunk length must be >= 1, got {length}")
  ids = np.asarray(ids)
  return [ids[s:s + length] for s in range(0, len(ids), length)]


def chunk_conversations(token_ids: Sequence[np.ndarray], domains: Sequence[str],
                        length: int, *, pack: bool = True
                        ) -> tuple[list[np.ndarray], list[str]]:
  """(chunks, their domains) of tokenized conversations; with `pack`, a
  domain's conversations are concatenated (in order) before chunking."""
  if not pack:
    pieces = [(p, d) for ids, d in zip(token_ids, domains) for p in chunk_ids(ids, length)]
  else:
    by_domain: dict[str, list[np.ndarray]] = {}
    for ids, d in zip(token_ids, domains):
      by_domain.setdefault(d, []).append(np.asarray(ids))
    pieces = [(p, d) for d, seqs in by_domain.items()
              for p in chunk_ids(np.concatenate(seqs), length)]
  return [p for p, _ in pieces], [d for _, d in pieces]


# ---------------------------------------------------------------------------
# seqio tasks.
# ---------------------------------------------------------------------------


def dialog_vocabulary(vocab_path: str = DEFAULT_BPE_VOCAB_PATH,
                      merges_path: str = DEFAULT_BPE_MERGES_PATH):
  """GPT-2 byte-level BPE with `CONTROL_TOKENS` appended as extra tokens
  (ids `base_size ..`, never split). A pretrained GPT-2 embedding needs
  `len(CONTROL_TOKENS)` more rows."""
  from dpjax.data import vocabularies  # pylint: disable=g-import-not-at-top

  return vocabularies.ByteLevelBPEVocabulary(vocab_path, merges_path,
                                             extra_tokens=CONTROL_TOKENS)


def _chunks_dataset(chunks: list[np.ndarray], domains: list[str]):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  lengths = np.array([len(c) for c in chunks], np.int64)
  values = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros([0], np.int32)
  return tf.data.Dataset.from_tensor_slices({
      "inputs": tf.zeros([len(chunks), 0], tf.int32),
      "targets": tf.RaggedTensor.from_row_lengths(values, lengths),
      "domain": tf.constant(domains, tf.string, shape=[len(chunks)]),
  })


def register_multidogo_task(
    name: str, *,
    data_dir: str | None = None,
    domains: Sequence[str] = PAPER_DOMAINS,
    policy: Callable[[], redaction.Policy] | None = None,
    domain_tokens: bool = True,
    chunk_length: int = DEFAULT_CHUNK_LENGTH,
    pack: bool = True,
    split_seed: int = 0,
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
    vocabulary: a seqio vocabulary; None means `dialog_vocabulary()`.
    on_malformed: "fail" or "skip" (see `read_conversations`).

  Returns:
    The registered `seqio.Task`.
  """
  import seqio  # pylint: disable=g-import-not-at-top

  if isinstance(domains, str):
    raise TypeError("domains must be a sequence of names, not a str")
  if on_malformed not in ("fail", "skip"):
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
    if make_policy:
      conversations = redact_conversations(conversations, make_policy())
    ids = [np.asarray(vocabulary.encode(format_conversation(
        c, domain_tokens=domain_tokens)), np.int32) for c in conversations]
    chunks, chunk_domains = chunk_conversations(
        ids, [c.domain for c in conversations], chunk_length, pack=pack)
    if shuffle_files:
      order = np.random.default_rng(seed).permutation(len(chunks))
      chunks, chunk_domains = [chunks[i] for i in order], [chunk_domains[i] for i in order]
    return _chunks_dataset(chunks, chunk_domains)

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


@gin.configurable(denylist=["checkpoint_tokenizer_files"])
def register_multidogo_tasks(
    data_dir: str | None = None,
    domains: Sequence[str] = PAPER_DOMAINS,
    domain_tokens: bool = True,
    chunk_length: int = DEFAULT_CHUNK_LENGTH,
    pack: bool = True,
    keywords_path: str | None = None,
    classifier_dir: str | None = None,
    classifier_threshold: float = 0.9,
    bpe_vocab_path: str | None = None,
    bpe_merges_path: str | None = None,
    split_seed: int = 0,
    on_malformed: str = "fail",
    checkpoint_tokenizer_files: Mapping[str, str] | None = None,
) -> list:
  """Registers the MultiDoGo LM tasks (all over `domains`, unless named):

  * `multidogo_lm`: original text (the paper's Public / Private training);
  * `multidogo_lm_redacted_keyword`: utterances redacted by the keyword
    policy of `keywords_path` (Pub+Redacted; JFT / redaction-schedule);
  * `multidogo_lm_redacted_classifier`: redacted by the classifier policy
    saved in `classifier_dir` with threshold z = `classifier_threshold`
    (registered only if `classifier_dir` is set);
  * `multidogo_lm_only_{domain}`: that domain alone (the DOMAIN_i Only
    baseline), and `multidogo_lm_without_{domain}`: the other domains (the
    reference model of D without d_j), `domain` lower case.

  Args:
    data_dir: MultiDoGo `unannotated/` directory; None means the sample.
    domains: the pooled domains (default the paper's AIRLINE, MEDIA,
      INSURANCE).
    domain_tokens, chunk_length, pack, split_seed, on_malformed: see
      `register_multidogo_task`.
    keywords_path: JSON phrase lists `{"DOMAIN": [...]}`; None means the
      sample's `keywords.json`. Redaction uses every domain of the policy
      (keyword file or classifier), selected or not.
    classifier_dir, classifier_threshold: the classifier policy.
    bpe_vocab_path, bpe_merges_path: GPT-2 `vocab.json` / `merges.txt`; None
      means the pretrained checkpoint's (`checkpoint_tokenizer_files`, passed
      by the trainer) if it has them, else the sample's. `CONTROL_TOKENS` are
      appended either way.
    checkpoint_tokenizer_files: `dpjax.pretrained.tokenizer_files` of the
      pretrained checkpoint, if any.

  Returns:
    The registered tasks.
  """
  from dpjax.data import vocabularies  # pylint: disable=g-import-not-at-top
  vocabulary = dialog_vocabulary(*vocabularies.bpe_paths(
      bpe_vocab_path, bpe_merges_path, checkpoint_tokenizer_files,
      default_vocab=DEFAULT_BPE_VOCAB_PATH, default_merges=DEFAULT_BPE_MERGES_PATH))
  keywords_path = keywords_path or DEFAULT_KEYWORDS_PATH
  if not os.path.isfile(keywords_path):
    raise FileNotFoundError(f"keyword file not found: {keywords_path!r}")
  domains = tuple(domains)
  policies = {"": None, "_redacted_keyword": lambda: redaction.KeywordPolicy.from_json(
      keywords_path)}
  if classifier_dir:
    policies["_redacted_classifier"] = lambda: redaction.ClassifierPolicy.from_dir(
        classifier_dir, threshold=classifier_threshold)
  register = functools.partial(
      register_multidogo_task, data_dir=data_dir, domain_tokens=domain_tokens,
      chunk_length=chunk_length, pack=pack, split_seed=split_seed,
      vocabulary=vocabulary, on_malformed=on_malformed)
  registered = [register(f"multidogo_lm{suffix}", domains=domains, policy=policy)
                for suffix, policy in policies.items()]
  for d in domains:
    registered.append(register(f"multidogo_lm_only_{d.lower()}", domains=(d,)))
    if len(domains) > 1:
      registered.append(register(f"multidogo_lm_without_{d.lower()}",
                                 domains=tuple(x for x in domains if x != d)))
  return registered


__all__ = [
    "DEFAULT_DATA_DIR", "DEFAULT_KEYWORDS_PATH", "DEFAULT_BPE_VOCAB_PATH",
    "DEFAULT_BPE_MERGES_PATH", "DOMAINS", "PAPER_DOMAINS", "CONTROL_TOKENS",
    "CONVERSATION_START", "CONVERSATION_END", "ROLE_TOKENS", "SPLITS",
    "SPLIT_FRACTIONS", "DEFAULT_CHUNK_LENGTH", "Utterance", "Conversation",
    "MalformedLineError", "domain_token", "domain_path", "read_conversations",
    "load_conversations", "split_conversations", "load_split",
    "utterance_texts", "redact_conversations", "format_conversation",
    "chunk_ids", "chunk_conversations", "dialog_vocabulary",
    "register_multidogo_task", "register_multidogo_tasks",
]
