"""MultiDoGo dialog readers of the domain-privacy experiments ("Domain
Private Transformers for Multi-Domain Dialog Systems"): conversations,
their splits, formatting, redaction and chunking.

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

Chunking (`chunk_conversations`): a domain's token sequences are
concatenated and cut into pieces of a fixed length (`pack=True`), or each
conversation is cut on its own (`pack=False`).

Pure Python and numpy (no TensorFlow); `tasks.multidogo` registers the seqio
tasks built on these readers.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
from typing import Iterable, Iterator, Sequence

import numpy as np

from dpjax.data.readers import SAMPLE_DATA_DIR, malformed
from dpjax.data.readers.malformed import MalformedLineError
from dpjax.data.text import redaction

DEFAULT_DATA_DIR = os.path.join(SAMPLE_DATA_DIR, "multidogo_sample")
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
  """One turn of a conversation: its number, speaker role and text."""
  turn_number: int
  role: str  # a key of ROLE_TOKENS
  text: str  # whitespace-normalised, non-empty


@dataclasses.dataclass(frozen=True)
class Conversation:
  """One conversation of `domain`, its utterances in turn order."""
  domain: str
  conversation_id: str
  utterances: tuple[Utterance, ...]  # by turn number


def domain_token(domain: str) -> str:
  """The control token of `domain`: `<DOMAIN>`."""
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
  domain's conversations are concatenated (in order) before chunking.
  Unpacked, `domains` may be any per-conversation label (e.g. its id)."""
  if not pack:
    pieces = [(p, d) for ids, d in zip(token_ids, domains)
              for p in chunk_ids(ids, length)]
  else:
    by_domain: dict[str, list[np.ndarray]] = {}
    for ids, d in zip(token_ids, domains):
      by_domain.setdefault(d, []).append(np.asarray(ids))
    pieces = [(p, d) for d, seqs in by_domain.items()
              for p in chunk_ids(np.concatenate(seqs), length)]
  return [p for p, _ in pieces], [d for _, d in pieces]


__all__ = [
    "DEFAULT_DATA_DIR", "DEFAULT_KEYWORDS_PATH", "DEFAULT_BPE_VOCAB_PATH",
    "DEFAULT_BPE_MERGES_PATH", "DOMAINS", "PAPER_DOMAINS", "CONTROL_TOKENS",
    "CONVERSATION_START", "CONVERSATION_END", "ROLE_TOKENS", "SPLITS",
    "SPLIT_FRACTIONS", "DEFAULT_CHUNK_LENGTH", "Utterance", "Conversation",
    "MalformedLineError", "domain_token", "domain_path", "read_conversations",
    "load_conversations", "split_conversations", "load_split",
    "utterance_texts", "redact_conversations", "format_conversation",
    "chunk_ids", "chunk_conversations",
]
