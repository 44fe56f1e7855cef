"""MSMARCO passage-ranking readers.

Files follow the published MSMARCO passage-ranking layout, all UTF-8, tab
separated, one record per line:

* `collection.tsv`          `pid \\t passage`
* `queries.{split}.tsv`     `qid \\t query`
* `qrels.{split}.tsv`       `qid \\t 0 \\t pid \\t relevance`  (TREC qrels)

with `split` in {"train", "dev"}. The readers are pure Python (no TF) and
memory-conscious: the qrels are read first and `collection.tsv` (8.8M passages
in the full dataset) is streamed keeping only the passages that are needed.
`tasks.msmarco` registers the seqio tasks built on them.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

from dpjax.data.readers import SAMPLE_DATA_DIR, malformed
from dpjax.data.readers.malformed import MalformedLineError

DEFAULT_SAMPLE_DIR = os.path.join(SAMPLE_DATA_DIR, "msmarco_sample")
COLLECTION_FILE = "collection.tsv"
# seqio split name -> MSMARCO file split name.
SPLITS = {"train": "train", "dev": "dev", "validation": "dev"}


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


def split_files(data_dir: str, split: str, pairs_dir: str | None = None
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


def relevant_qrels(path: str, on_malformed: str
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
  paths = split_files(data_dir, split, pairs_dir)
  qrels = relevant_qrels(paths["qrels"], on_malformed)
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
  paths = split_files(data_dir, split)
  return list(dict.fromkeys(
      pid for _, pid, _ in relevant_qrels(paths["qrels"], on_malformed)))


__all__ = [
    "DEFAULT_SAMPLE_DIR", "COLLECTION_FILE", "SPLITS", "EmptyFileError",
    "MalformedLineError", "read_tsv_pairs", "read_qrels", "split_files",
    "relevant_qrels", "load_query_passage_pairs", "load_collection_ids",
]
