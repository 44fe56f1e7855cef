"""BEIR readers (Thakur et al. 2021, the retrieval paper's zero-shot
datasets): a dataset directory holds `corpus.jsonl` (`{"_id", "title",
"text"}` per line), `queries.jsonl` (`{"_id", "text"}`) and
`qrels/{split}.tsv` (header `query-id \\t corpus-id \\t score`, then one
graded judgement per line).

Ids are strings, as in a TREC run file, so they may not contain whitespace.
Every malformed line is a `MalformedLineError("path:line: why")`.
`dpjax.eval.ir_data.load_beir` assembles an evaluation dataset from them.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

from dpjax.data.readers import SAMPLE_DATA_DIR
from dpjax.data.readers.malformed import MalformedLineError

QRELS_HEADER = ("query-id", "corpus-id", "score")
# The embedded BEIR-format sample (python -m tasks.beir_sample.generate).
SAMPLE_DIR = os.path.join(SAMPLE_DATA_DIR, "beir_sample")

# qid -> {doc id: (relevance, line of the qrels file)}
Judgements = dict[str, dict[str, tuple[int, int]]]


def check_id(doc_id: str, path: str, lineno: int, what: str) -> str:
  """`doc_id`, if it is non-empty and has no whitespace."""
  if not doc_id or doc_id.split() != [doc_id]:
    raise MalformedLineError(path, lineno,
                             f"{what} {doc_id!r} is empty or contains whitespace")
  return doc_id


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


def read_corpus(path: str) -> Iterator[tuple[str, str]]:
  """Streams `(doc id, text)` from a BEIR `corpus.jsonl`.

  The text is `title + " " + text` (BEIR's own convention for encoders), or
  the text alone when the title is empty or absent. Raises
  `MalformedLineError` on invalid JSON, a missing or non-string `_id` or
  `text`, an id with whitespace, or a duplicate id.
  """
  seen: set[str] = set()
  for lineno, record in _read_jsonl(path):
    doc_id = check_id(_field(record, "_id", path, lineno), path, lineno, "id")
    text = _field(record, "text", path, lineno)
    title = _field(record, "title", path, lineno, default="")
    if doc_id in seen:
      raise MalformedLineError(path, lineno, f"duplicate id {doc_id!r}")
    seen.add(doc_id)
    yield doc_id, f"{title} {text}" if title else text


def read_qrels(path: str) -> Judgements:
  """`{qid: {doc id: (relevance, lineno)}}` from a BEIR `qrels/{split}.tsv`.

  The first line must be the header `query-id \\t corpus-id \\t score`; every
  other non-blank line has three tab-separated fields and an integer score.
  A repeated (query, document) pair is malformed unless it repeats the score.
  """
  qrels: Judgements = {}
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError as e:
        raise MalformedLineError(path, lineno, f"invalid UTF-8 ({e.reason})") from None
      fields = line.split("\t")
      if lineno == 1:
        if tuple(f.strip() for f in fields) != QRELS_HEADER:
          raise MalformedLineError(
              path, lineno, f"expected the header {chr(9).join(QRELS_HEADER)!r}, "
              f"got {line!r}")
        continue
      if not line.strip():
        continue
      if len(fields) != 3:
        raise MalformedLineError(
            path, lineno, f"expected 3 tab-separated columns, got {len(fields)}")
      qid = check_id(fields[0].strip(), path, lineno, "query id")
      doc_id = check_id(fields[1].strip(), path, lineno, "corpus id")
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


def read_queries(path: str) -> Iterator[tuple[str, str]]:
  """Streams `(qid, text)` from a BEIR `queries.jsonl`; raises
  `MalformedLineError` as `read_corpus` does (no title here)."""
  seen: set[str] = set()
  for lineno, record in _read_jsonl(path):
    qid = check_id(_field(record, "_id", path, lineno), path, lineno, "id")
    text = _field(record, "text", path, lineno)
    if qid in seen:
      raise MalformedLineError(path, lineno, f"duplicate id {qid!r}")
    seen.add(qid)
    yield qid, text


__all__ = ["QRELS_HEADER", "SAMPLE_DIR", "Judgements", "MalformedLineError",
           "check_id", "read_corpus", "read_qrels", "read_queries"]
