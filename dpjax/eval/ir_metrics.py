"""Ranking metrics through trec_eval (pytrec_eval), and TREC run files.

The paper reports NDCG@10 and Recall@10 (section 6.1); MRR@10 is MSMARCO's
official measure. All three come from trec_eval's own code (pytrec_eval,
as BEIR computes them):

* NDCG@10 = `ndcg_cut.10`: gain = the graded relevance, discount
  1 / log2(rank + 1), normalised by the ideal ordering of all judged
  documents;
* Recall@10 = `recall.10`: relevant documents in the top 10 / all relevant;
* MRR@10 = `recip_rank` of the ranking cut to its top 10 (1 / rank of the
  first relevant document, 0 if none is in the top 10).

"Relevant" means relevance > 0. trec_eval re-sorts a run by score and breaks
ties by document id (descending), so the ranking is handed to it with
scores that decrease strictly along the ranks: what is evaluated is exactly
the ranking given. The means are over the queries with a relevant judgement;
such a query missing from the ranking scores 0 (trec_eval's `-c`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pytrec_eval

from dpjax import fileio

Qrels = Mapping[str, Mapping[str, int]]
Ranking = Mapping[str, Sequence[str]]  # qid -> doc ids, best first


def per_query(ranking: Ranking, qrels: Qrels, cutoff: int = 10
              ) -> dict[str, dict[str, float]]:
  """`{qid: {"ndcg@10", "recall@10", "mrr@10"}}` for every query of `qrels`
  with a judgement of relevance > 0 (names use `cutoff`)."""
  judged = {q: {d: int(r) for d, r in docs.items()} for q, docs in qrels.items()
            if any(r > 0 for r in docs.values())}
  if not judged:
    raise ValueError("the qrels have no judgement with relevance > 0")

  def run(depth: int | None) -> dict[str, dict[str, float]]:
    return {q: {d: float(len(docs) - rank) for rank, d in enumerate(docs[:depth])}
            for q, docs in ranking.items() if q in judged and len(docs)}

  full = pytrec_eval.RelevanceEvaluator(
      judged, {f"ndcg_cut.{cutoff}", f"recall.{cutoff}"}).evaluate(run(None))
  top = pytrec_eval.RelevanceEvaluator(judged, {"recip_rank"}).evaluate(run(cutoff))
  zero = {f"ndcg_cut_{cutoff}": 0.0, f"recall_{cutoff}": 0.0, "recip_rank": 0.0}
  return {q: {f"ndcg@{cutoff}": full.get(q, zero)[f"ndcg_cut_{cutoff}"],
              f"recall@{cutoff}": full.get(q, zero)[f"recall_{cutoff}"],
              f"mrr@{cutoff}": top.get(q, zero)["recip_rank"]}
          for q in judged}


def evaluate(ranking: Ranking, qrels: Qrels, cutoff: int = 10) -> dict[str, float]:
  """Mean NDCG@cutoff, Recall@cutoff, MRR@cutoff and `num_queries`."""
  values = per_query(ranking, qrels, cutoff)
  names = next(iter(values.values())).keys()
  means = {name: float(np.mean([v[name] for v in values.values()])) for name in names}
  return {**means, "num_queries": len(values)}


def write_trec_run(path: str, qids: Sequence[str], doc_ids: Sequence[Sequence[str]],
                   scores: np.ndarray, run_name: str) -> None:
  """Writes `qid Q0 docid rank score run_name` lines (rank from 1), atomically."""
  if run_name.split() != [run_name]:
    raise ValueError(f"run name {run_name!r} is empty or contains whitespace")
  with fileio.open_atomic(path) as f:  # streamed: 100 lines per query
    for q, docs, row in zip(qids, doc_ids, np.asarray(scores).tolist(), strict=True):
      f.writelines(f"{q} Q0 {d} {rank} {score:.9g} {run_name}\n"
                   for rank, (d, score) in enumerate(zip(docs, row, strict=True), start=1))
