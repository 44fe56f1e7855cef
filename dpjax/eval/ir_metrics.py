"""Ranking metrics exactly as trec_eval computes them (pytrec_eval), and TREC
run and qrels files.

The paper reports NDCG@10 and Recall@10 (section 6.1); MRR@10 is MSMARCO's
official measure. All three come from trec_eval's own code (pytrec_eval,
as BEIR computes them):

* NDCG@10 = `ndcg_cut.10`: gain = the graded relevance, discount
  1 / log2(rank + 1), normalised by the ideal ordering of all judged
  documents;
* Recall@10 = `recall.10`: relevant documents in the top 10 / all relevant;
* MRR@10 = `recip_rank` of the ranking cut to its top 10 (trec_eval's
  `-M 10`): 1 / rank of the first relevant document, 0 if none is in the
  top 10.

"Relevant" means relevance > 0 (trec_eval's default level 1). A run is what
trec_eval reads from a run file, `{qid: {doc id: score}}`; trec_eval ranks
a query's documents by score descending and breaks ties by document id
descending (`strcmp`), ignoring the rank column (`trec_order`).
`write_trec_run` writes the lines in that order, so the file's ranks are
the evaluated ones, and `evaluate` of `read_trec_run` of that file gives
what

  trec_eval -c -M 10 -m ndcg_cut.10 -m recall.10 -m recip_rank QRELS RUN

prints. Averages are over every query of the qrels, as with `-c`: a query
without any judgement of relevance > 0 scores 0 on all three measures, and
so does a query missing from the run (`AVERAGED_OVER`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pytrec_eval

from dpjax import fileio
from dpjax.data.readers.malformed import MalformedLineError

Qrels = Mapping[str, Mapping[str, int]]
Run = Mapping[str, Mapping[str, float]]  # qid -> {doc id: score}

AVERAGED_OVER = (
    "every query of the qrels, as trec_eval -c: a query without a judgement "
    "of relevance > 0, or missing from the run, scores 0")


def trec_order(docs: Mapping[str, float]) -> list[str]:
  """A query's doc ids as trec_eval ranks them: score descending, then doc id
  descending (Python's `str` order is `strcmp`'s order of the UTF-8 bytes)."""
  return sorted(sorted(docs, reverse=True), key=lambda d: -docs[d])


def _names(cutoff: int) -> tuple[str, str, str]:
  return f"ndcg@{cutoff}", f"recall@{cutoff}", f"mrr@{cutoff}"


def per_query(run: Run, qrels: Qrels, cutoff: int = 10
              ) -> dict[str, dict[str, float]]:
  """`{qid: {"ndcg@10", "recall@10", "mrr@10"}}` for every query of `qrels`
  (names use `cutoff`); what `trec_eval -q -c -M cutoff` prints per query."""
  if not qrels:
    raise ValueError("the qrels have no queries")
  judged = {q: {d: int(r) for d, r in docs.items()} for q, docs in qrels.items()}
  # trec_eval -M cutoff: each query's ranking cut to its first `cutoff`.
  top = {}
  for q, docs in run.items():
    if q in judged and docs:
      scores = {d: float(s) for d, s in docs.items()}
      top[q] = {d: scores[d] for d in trec_order(scores)[:cutoff]}
  measures = (f"ndcg_cut_{cutoff}", f"recall_{cutoff}", "recip_rank")
  values = pytrec_eval.RelevanceEvaluator(
      judged, {f"ndcg_cut.{cutoff}", f"recall.{cutoff}", "recip_rank"}).evaluate(top)
  return {q: {name: float(values[q][m]) if q in values else 0.0
              for name, m in zip(_names(cutoff), measures)}
          for q in judged}


def evaluate(run: Run, qrels: Qrels, cutoff: int = 10) -> dict:
  """Means of NDCG@cutoff, Recall@cutoff and MRR@cutoff over every query of
  `qrels` (trec_eval -c), `num_queries` and `num_queries_without_relevant`."""
  values = per_query(run, qrels, cutoff)
  means = {name: float(np.mean([v[name] for v in values.values()]))
           for name in _names(cutoff)}
  return {**means, "num_queries": len(values),
          "num_queries_without_relevant": sum(
              not any(r > 0 for r in docs.values()) for docs in qrels.values())}


def write_trec_run(path: str, qids: Sequence[str], doc_ids: Sequence[Sequence[str]],
                   scores: np.ndarray, run_name: str) -> None:
  """Writes `qid Q0 docid rank score run_name` lines, atomically.

  Scores are written with 9 significant digits, which tells every float32
  apart and keeps their order; each query's lines are in `trec_order` of the
  written scores, ranks from 1, so the file lists each ranking as trec_eval
  evaluates it.
  """
  if run_name.split() != [run_name]:
    raise ValueError(f"run name {run_name!r} is empty or contains whitespace")
  with fileio.open_atomic(path) as f:  # streamed: top_k lines per query
    for q, docs, row in zip(qids, doc_ids, np.asarray(scores).tolist(), strict=True):
      written = {}
      for d, score in zip(docs, row, strict=True):
        if d in written:
          raise ValueError(f"query {q}: document {d} twice in the ranking")
        written[d] = f"{score:.9g}"
      parsed = {d: float(s) for d, s in written.items()}
      f.writelines(f"{q} Q0 {d} {rank} {written[d]} {run_name}\n"
                   for rank, d in enumerate(trec_order(parsed), start=1))


def read_trec_run(path: str) -> dict[str, dict[str, float]]:
  """`{qid: {doc id: score}}` from a TREC run file (`qid Q0 docid rank score
  run_name`, whitespace separated); `MalformedLineError` names file:line."""
  run: dict[str, dict[str, float]] = {}
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      fields = line.split()
      if not fields:
        continue
      if len(fields) != 6:
        raise MalformedLineError(path, lineno, f"expected 6 fields, got {len(fields)}")
      q, _, d, _, score, _ = fields
      try:
        value = float(score)
      except ValueError:
        raise MalformedLineError(path, lineno, f"score {score!r} is not a number"
                                 ) from None
      if d in run.setdefault(q, {}):
        raise MalformedLineError(path, lineno, f"document {d} twice for query {q}")
      run[q][d] = value
  return run


def write_trec_qrels(path: str, qrels: Qrels) -> None:
  """Writes `qid 0 docid relevance` lines (trec_eval's qrels), atomically."""
  with fileio.open_atomic(path) as f:
    for q, docs in qrels.items():
      f.writelines(f"{q} 0 {d} {int(r)}\n" for d, r in docs.items())
