"""Retrieval evaluation datasets from local directories: MSMARCO and BEIR.

* MSMARCO passage ranking (`load_msmarco`): `collection.tsv`,
  `queries.{split}.tsv` and `qrels.{split}.tsv`, read with the
  `dpjax.data.readers.msmarco` readers (e.g. split "dev", or "dev.small" for
  `queries.dev.small.tsv`);
* BEIR (`load_beir`, Thakur et al. 2021, the paper's zero-shot datasets):
  `corpus.jsonl`, `queries.jsonl` and `qrels/{split}.tsv`, read with the
  `dpjax.data.readers.beir` readers.

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
import logging
import os
from typing import Callable, Iterator

from dpjax.data.readers import beir, msmarco
from dpjax.data.readers.malformed import MalformedLineError

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
  """A dataset that cannot be evaluated: an empty corpus, queries or qrels."""


Qrels = dict[str, dict[str, int]]  # qid -> {doc id: relevance}


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


def _check_judged(qrels: beir.Judgements, path: str) -> None:
  if not qrels:
    raise DatasetError(f"{path}: no judgements")
  if not any(rel > 0 for docs in qrels.values() for rel, _ in docs.values()):
    raise DatasetError(f"{path}: no judgement with relevance > 0")


def _finish(name: str, corpus_path: str, read: Callable[[], Iterator[tuple[str, str]]],
            queries: dict[str, str], qrels: beir.Judgements,
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
  qrels: beir.Judgements = {}
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


def load_beir(data_dir: str = beir.SAMPLE_DIR, split: str = "test") -> IRDataset:
  """A BEIR dataset directory: `corpus.jsonl`, `queries.jsonl`,
  `qrels/{split}.tsv`.

  Reads the qrels, then the judged queries' texts, then streams the corpus
  once to count and check it before any encoding starts.
  """
  corpus_path, queries_path, qrels_path = _require_files(
      data_dir, ["corpus.jsonl", "queries.jsonl", os.path.join("qrels", f"{split}.tsv")],
      f"BEIR ({split!r} split)")
  qrels = beir.read_qrels(qrels_path)
  _check_judged(qrels, qrels_path)
  texts: dict[str, str] = {}
  num_queries = 0
  for qid, text in beir.read_queries(queries_path):
    num_queries += 1
    if qid in qrels:
      texts[qid] = text
  if not num_queries:
    raise DatasetError(f"{queries_path}: no queries")
  for qid, docs in qrels.items():
    if qid not in texts:
      raise MalformedLineError(
          qrels_path, min(lineno for _, lineno in docs.values()),
          f"query {qid!r} not found in queries.jsonl")
  name = f"beir/{os.path.basename(os.path.normpath(data_dir))}/{split}"
  return _finish(name, corpus_path, lambda: beir.read_corpus(corpus_path),
                 {q: texts[q] for q in qrels}, qrels, qrels_path)
