"""Retrieval evaluation datasets from local directories: MSMARCO and BEIR.

* MSMARCO passage ranking (`load_msmarco`): `collection.tsv`,
  `queries.{split}.tsv` and `qrels.{split}.tsv`, read with the
  `tasks.msmarco` readers (e.g. split "dev", or "dev.small" for
  `queries.dev.small.tsv`);
* BEIR (`load_beir`, Thakur et al. 2021, the paper's zero-shot datasets):
  `corpus.jsonl` (`{"_id", "title", "text"}` per line), `queries.jsonl`
  (`{"_id", "text"}`) and `qrels/{split}.tsv` (header
  `query-id \\t corpus-id \\t score`, then one graded judgement per line).

A dataset keeps the judged queries and their qrels in memory and streams the
corpus (8.8M passages for MSMARCO) from its file each time it is iterated.
Ids are strings, as in a TREC run file, so they may not contain whitespace.
Every malformed line is a `MalformedLineError("path:line: why")`.

Every query of the qrels is kept and searched, those whose judgements are all
0 too: `ir_metrics` averages over all of them as `trec_eval -c` does (such a
query scores 0). A judged document missing from the corpus is kept (it
counts as relevant and never retrieved, as trec_eval counts it) and
reported, since some published qrels have such rows. A dataset that cannot
be evaluated (no documents, no queries, no judgement of relevance > 0) is a
`DatasetError`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Callable, Iterator

from tasks import msmarco
from tasks.msmarco import MalformedLineError

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
  """A dataset that cannot be evaluated: an empty corpus, queries or qrels."""


BEIR_QRELS_HEADER = ("query-id", "corpus-id", "score")
# The embedded BEIR-format sample (python -m tasks.beir_sample.generate).
BEIR_SAMPLE_DIR = os.path.join(os.path.dirname(msmarco.DEFAULT_SAMPLE_DIR), "beir_sample")

Qrels = dict[str, dict[str, int]]  # qid -> {doc id: relevance}
# qid -> {doc id: (relevance, line of the qrels file)}, while loading.
_Judgements = dict[str, dict[str, tuple[int, int]]]


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A document collection streamed from `path` in file order."""
  path: str
  num_docs: int
  read: Callable[[], Iterator[tuple[str, str]]]  # -> (doc id, text)

  def __iter__(self) -> Iterator[tuple[str, str]]:
    return self.read()


@dataclasses.dataclass(frozen=True)
class IRDataset:
  """A corpus, the evaluated queries and their graded relevance judgements.

  `missing_judged_docs` counts the (qid, doc id) judgements whose document is
  not in the corpus.
  """
  name: str
  corpus: Corpus
  queries: dict[str, str]  # qid -> text, in qrels order
  qrels: Qrels
  missing_judged_docs: int = 0


def _require_files(data_dir: str, names: list[str], what: str) -> list[str]:
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"{what} data directory not found: {data_dir!r} "
                            f"(expected {', '.join(names)})")
  paths = [os.path.join(data_dir, n) for n in names]
  missing = [n for n, p in zip(names, paths) if not os.path.isfile(p)]
  if missing:
    raise FileNotFoundError(f"{what} files missing in {data_dir!r}: "
                            f"{', '.join(missing)}")
  return paths


def _check_id(doc_id: str, path: str, lineno: int, what: str) -> str:
  if not doc_id or doc_id.split() != [doc_id]:
    raise MalformedLineError(path, lineno,
                             f"{what} {doc_id!r} is empty or contains whitespace")
  return doc_id


def _check_judged(qrels: _Judgements, path: str) -> None:
  if not qrels:
    raise DatasetError(f"{path}: no judgements")
  if not any(rel > 0 for docs in qrels.values() for rel, _ in docs.values()):
    raise DatasetError(f"{path}: no judgement with relevance > 0")


def _finish(name: str, corpus_path: str, read: Callable[[], Iterator[tuple[str, str]]],
            queries: dict[str, str], qrels: _Judgements,
            qrels_path: str) -> IRDataset:
  """Counts (and so validates) the corpus once and checks the judged docs."""
  judged_docs = {d for docs in qrels.values() for d in docs}
  found: set[str] = set()
  num_docs = 0
  for doc_id, _ in read():
    num_docs += 1
    if doc_id in judged_docs:
      found.add(doc_id)
  if not num_docs:
    raise DatasetError(f"{corpus_path}: the corpus has no documents")
  missing = [(lineno, q, d) for q, docs in qrels.items()
             for d, (_, lineno) in docs.items() if d not in found]
  if missing:
    lineno, q, d = min(missing)
    logger.warning("%d judgements name documents missing from %s (first: "
                   "%s:%d: query %s, document %s); they count as never "
                   "retrieved", len(missing), corpus_path, qrels_path, lineno,
                   q, d)
  return IRDataset(
      name=name, corpus=Corpus(corpus_path, num_docs, read), queries=queries,
      qrels={q: {d: rel for d, (rel, _) in docs.items()}
             for q, docs in qrels.items()},
      missing_judged_docs=len(missing))


def load_msmarco(data_dir: str = msmarco.DEFAULT_SAMPLE_DIR,
                 split: str = "dev") -> IRDataset:
  """MSMARCO passage ranking: `collection.tsv`, `queries.{split}.tsv`,
  `qrels.{split}.tsv` in `data_dir` (default: the embedded sample).

  Reads the qrels, then the judged queries, then streams the collection
  once to count it and check it (bad lines, duplicate pids) before any
  encoding starts.
  """
  collection, queries_path, qrels_path = _require_files(
      data_dir, [msmarco.COLLECTION_FILE, f"queries.{split}.tsv",
                 f"qrels.{split}.tsv"], f"MSMARCO ({split!r} split)")
  qrels: _Judgements = {}
  for qid, pid, rel, lineno in msmarco.read_qrels(qrels_path):
    qrels.setdefault(str(qid), {})[str(pid)] = (rel, lineno)
  _check_judged(qrels, qrels_path)
  texts = dict(msmarco.read_tsv_pairs(queries_path,
                                      keep_ids={int(q) for q in qrels}))
  if not texts:
    raise DatasetError(f"{queries_path}: none of the {len(qrels)} queries of "
                       f"{os.path.basename(qrels_path)} is there (an empty file?)")
  for qid, docs in qrels.items():
    if int(qid) not in texts:
      raise MalformedLineError(
          qrels_path, min(lineno for _, lineno in docs.values()),
          f"query {qid} not found in {os.path.basename(queries_path)}")

  def read() -> Iterator[tuple[str, str]]:
    return ((str(pid), text) for pid, text in msmarco.read_tsv_pairs(collection))

  return _finish(f"msmarco/{split}", collection, read,
                 {q: texts[int(q)] for q in qrels}, qrels, qrels_path)


# ---------------------------------------------------------------------------
# BEIR.
# ---------------------------------------------------------------------------


def _read_jsonl(path: str) -> Iterator[tuple[int, dict]]:
  """(lineno, object) of each non-blank line of a JSON-lines file."""
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise MalformedLineError(path, lineno, f"invalid UTF-8 ({e.reason})") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise MalformedLineError(path, lineno, f"invalid JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise MalformedLineError(path, lineno, "expected a JSON object")
      yield lineno, record


def _field(record: dict, key: str, path: str, lineno: int, *,
           default: str | None = None) -> str:
  value = record.get(key, default)
  if value is None:
    raise MalformedLineError(path, lineno, f"missing field {key!r}")
  if key == "_id" and isinstance(value, int) and not isinstance(value, bool):
    value = str(value)  # some corpora write numeric ids
  if not isinstance(value, str):
    raise MalformedLineError(
        path, lineno, f"field {key!r} must be a string, got {type(value).__name__}")
  return value


def read_beir_corpus(path: str) -> Iterator[tuple[str, str]]:
  """Streams `(doc id, text)` from a BEIR `corpus.jsonl`.

  The text is `title + " " + text` (BEIR's own convention for encoders), or
  the text alone when the title is empty or absent. Raises
  `MalformedLineError` on invalid JSON, a missing or non-string `_id` or
  `text`, an id with whitespace, or a duplicate id.
  """
  seen: set[str] = set()
  for lineno, record in _read_jsonl(path):
    doc_id = _check_id(_field(record, "_id", path, lineno), path, lineno, "id")
    text = _field(record, "text", path, lineno)
    title = _field(record, "title", path, lineno, default="")
    if doc_id in seen:
      raise MalformedLineError(path, lineno, f"duplicate id {doc_id!r}")
    seen.add(doc_id)
    yield doc_id, f"{title} {text}" if title else text


def read_beir_qrels(path: str) -> _Judgements:
  """`{qid: {doc id: (relevance, lineno)}}` from a BEIR `qrels/{split}.tsv`.

  The first line must be the header `query-id \\t corpus-id \\t score`; every
  other non-blank line has three tab-separated fields and an integer score.
  A repeated (query, document) pair is malformed unless it repeats the score.
  """
  qrels: _Judgements = {}
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError as e:
        raise MalformedLineError(path, lineno, f"invalid UTF-8 ({e.reason})") from None
      fields = line.split("\t")
      if lineno == 1:
        if tuple(f.strip() for f in fields) != BEIR_QRELS_HEADER:
          raise MalformedLineError(
              path, lineno, f"expected the header {chr(9).join(BEIR_QRELS_HEADER)!r}, "
              f"got {line!r}")
        continue
      if not line.strip():
        continue
      if len(fields) != 3:
        raise MalformedLineError(
            path, lineno, f"expected 3 tab-separated columns, got {len(fields)}")
      qid = _check_id(fields[0].strip(), path, lineno, "query id")
      doc_id = _check_id(fields[1].strip(), path, lineno, "corpus id")
      try:
        rel = int(fields[2])
      except ValueError:
        raise MalformedLineError(
            path, lineno, f"score must be an integer, got {fields[2]!r}") from None
      previous = qrels.setdefault(qid, {}).get(doc_id)
      if previous is not None and previous[0] != rel:
        raise MalformedLineError(
            path, lineno, f"({qid}, {doc_id}) judged {rel} here and "
            f"{previous[0]} on line {previous[1]}")
      if previous is None:
        qrels[qid][doc_id] = (rel, lineno)
  return qrels


def load_beir(data_dir: str = BEIR_SAMPLE_DIR, split: str = "test") -> IRDataset:
  """A BEIR dataset directory: `corpus.jsonl`, `queries.jsonl`,
  `qrels/{split}.tsv`.

  Reads the qrels, then the judged queries' texts, then streams the corpus
  once to count and check it before any encoding starts.
  """
  corpus_path, queries_path, qrels_path = _require_files(
      data_dir, ["corpus.jsonl", "queries.jsonl", os.path.join("qrels", f"{split}.tsv")],
      f"BEIR ({split!r} split)")
  qrels = read_beir_qrels(qrels_path)
  _check_judged(qrels, qrels_path)
  texts: dict[str, str] = {}
  seen: set[str] = set()
  for lineno, record in _read_jsonl(queries_path):
    qid = _check_id(_field(record, "_id", queries_path, lineno), queries_path,
                    lineno, "id")
    text = _field(record, "text", queries_path, lineno)
    if qid in seen:
      raise MalformedLineError(queries_path, lineno, f"duplicate id {qid!r}")
    seen.add(qid)
    if qid in qrels:
      texts[qid] = text
  if not seen:
    raise DatasetError(f"{queries_path}: no queries")
  for qid, docs in qrels.items():
    if qid not in texts:
      raise MalformedLineError(
          qrels_path, min(lineno for _, lineno in docs.values()),
          f"query {qid!r} not found in queries.jsonl")
  name = f"beir/{os.path.basename(os.path.normpath(data_dir))}/{split}"
  return _finish(name, corpus_path, lambda: read_beir_corpus(corpus_path),
                 {q: texts[q] for q in qrels}, qrels, qrels_path)
