"""`python -m dpjax.eval.retrieval`: retrieval quality of a trained dual encoder.

  python -m dpjax.eval.retrieval --model_dir=RUN [--dataset=msmarco|beir]
      [--data_dir=DIR] [--split=dev|test] [--output_dir=OUT] [--top_k=100]
      [--shard_size=10000] [--batch_size=256] [--backend=device|cpu]
      [--doc_length=384] [--query_length=128] [--vocabulary=SPM_MODEL]

The paper's evaluation (section 6.1): MSMARCO dev (default: the embedded
sample) or any BEIR-format directory for zero-shot evaluation. The corpus is
encoded in shards that a restarted job reuses (`encoding.encode_corpus`),
the queries in memory; exact top-k search streams over the shards
(`search`, ties broken as trec_eval breaks them: document id descending);
the ranking goes to a TREC run file, and the metrics are trec_eval's on that
file as read back (`ir_metrics`): metrics.json holds exactly what

  trec_eval -c -M 10 -m ndcg_cut.10 -m recall.10 -m recip_rank qrels.trec run.trec

prints, averaged over every query of the qrels (one without a judgement of
relevance > 0 scores 0). Outputs, under OUT (default RUN/retrieval/<dataset>):

  embeddings/   spec.json, shard-NNNNN-of-NNNNN.{npy,json}
  run.trec      qid Q0 docid rank score run_name, top_k per query, each
                query's lines in trec_eval's order
  qrels.trec    the judgements evaluated, qid 0 docid relevance
  metrics.json  NDCG@10, Recall@10, MRR@10, counts, settings, model step

A dataset that cannot be evaluated (no documents, queries or judgement of
relevance > 0), a malformed line or a bad flag is one `error: ...` line on
stderr and exit status 2, before anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from dpjax import errors, fileio, gin_cli
from dpjax.generation import inference
from dpjax.training import partitioning, reporting
from dpjax.data.readers import beir, msmarco
from dpjax.eval import encoding, ir_data, ir_metrics, search
from dpjax.models import dual_encoder
from tasks import msmarco as msmarco_tasks

CUTOFF = 10  # the paper's @10
DEFAULT_SPLITS = {"msmarco": "dev", "beir": "test"}


def _doc_ids(shards: Sequence[encoding.Shard], indices: np.ndarray) -> np.ndarray:
  """Corpus positions -> doc ids, shard by shard (no corpus-wide id table)."""
  starts = np.array([s.start for s in shards])
  which = np.searchsorted(starts, indices, side="right") - 1
  ids = np.empty(indices.shape, dtype=object)
  for s in np.unique(which):
    rows = which == s
    ids[rows] = np.asarray(shards[s].ids, dtype=object)[indices[rows] - starts[s]]
  return ids


def _load_logging(shards: Sequence[encoding.Shard], log: Callable[[str], None]):
  """Each shard's embeddings in turn, with a progress line every tenth."""
  every = max(1, len(shards) // 10)
  for i, shard in enumerate(shards):
    if i and i % every == 0:
      log(f"searched {i}/{len(shards)} shards")
    yield shard.load()


def evaluate_retrieval(dataset: ir_data.IRDataset,
                       encode_fn: Callable[[np.ndarray], Any],
                       tokenizer: Callable[[Sequence[str], int], np.ndarray],
                       output_dir: str, *, fingerprint: dict,
                       doc_length: int = 384, query_length: int = 128,
                       batch_size: int = 256, shard_size: int = 10_000,
                       top_k: int = 100, backend: str = "device",
                       run_name: str = "dpjax", mesh=None,
                       log: Callable[[str], None] = reporting.say) -> dict:
  """Encodes, searches, writes the run file and scores it; returns the results.

  Args:
    dataset: from `ir_data.load_msmarco` / `ir_data.load_beir`.
    encode_fn: int32 `[batch_size, length]` tokens (pad 0) -> `[batch_size, d]`
      embeddings (e.g. `encoding.device_encode_fn` of the dual encoder); called
      with `length` = `doc_length` and `query_length`.
    tokenizer: `(texts, length) -> int32 [n, length]`, e.g. `encoding.Tokenizer`.
    output_dir: where embeddings/, run.trec and metrics.json go.
    fingerprint: JSON-able identity of the encoder; a restart reuses
      embeddings only under the same fingerprint, shard size and corpus.
    top_k: results kept per query (at least 10; at most the corpus size).
    backend: search back end, "device" | "cpu" (`search.search`).
  """
  if top_k < CUTOFF:
    raise errors.UsageError(f"--top_k must be at least {CUTOFF}, got {top_k}")
  start = time.perf_counter()
  corpus = dataset.corpus
  k = min(top_k, corpus.num_docs)
  log(f"{dataset.name}: {len(dataset.queries):,} queries, {corpus.num_docs:,} "
      f"documents in shards of {shard_size:,} -> {output_dir}")
  shards = encoding.encode_corpus(
      corpus, corpus.num_docs, os.path.join(output_dir, "embeddings"),
      encoding.TextEncoder(encode_fn, tokenizer, doc_length, batch_size),
      shard_size=shard_size, fingerprint={**fingerprint, "doc_length": doc_length},
      log=log)
  qids = list(dataset.queries)
  queries = encoding.TextEncoder(encode_fn, tokenizer, query_length, batch_size)(
      [dataset.queries[q] for q in qids])
  log(f"searching {len(shards)} shards for the top {k} of {len(qids):,} queries "
      f"({backend})")
  scores, indices = search.search(
      queries, _load_logging(shards, log), k=k, shard_size=shard_size,
      block_size=batch_size, backend=backend, mesh=mesh,
      tie_keys=search.trec_tie_keys(i for s in shards for i in s.ids))
  doc_ids = _doc_ids(shards, indices)

  run_path = os.path.join(output_dir, "run.trec")
  qrels_path = os.path.join(output_dir, "qrels.trec")
  ir_metrics.write_trec_run(run_path, qids, doc_ids, scores, run_name)
  ir_metrics.write_trec_qrels(qrels_path, dataset.qrels)
  # Scored from the file as written: what trec_eval reads.
  metrics = ir_metrics.evaluate(ir_metrics.read_trec_run(run_path), dataset.qrels,
                                CUTOFF)
  results = {
      "dataset": dataset.name, **metrics,
      "averaged_over": ir_metrics.AVERAGED_OVER, "num_docs": corpus.num_docs,
      "missing_judged_docs": dataset.missing_judged_docs, "top_k": k,
      "doc_length": doc_length, "query_length": query_length,
      "backend": backend, "run_file": run_path, "qrels_file": qrels_path,
      "trec_eval": f"trec_eval -c -M {CUTOFF} -m ndcg_cut.{CUTOFF} -m recall."
                   f"{CUTOFF} -m recip_rank {qrels_path} {run_path}",
      "encoder": fingerprint, "seconds": round(time.perf_counter() - start, 1),
  }
  fileio.write_atomic(os.path.join(output_dir, "metrics.json"),
                      json.dumps(results, indent=1) + "\n")
  log(f"{dataset.name}: NDCG@{CUTOFF} {metrics[f'ndcg@{CUTOFF}']:.4f} | "
      f"Recall@{CUTOFF} {metrics[f'recall@{CUTOFF}']:.4f} | MRR@{CUTOFF} "
      f"{metrics[f'mrr@{CUTOFF}']:.4f} over {metrics['num_queries']:,} queries "
      f"({metrics['num_queries_without_relevant']:,} without a relevant "
      f"document, scored 0) ({results['seconds']:.0f}s) -> {output_dir}")
  return results


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m dpjax.eval.retrieval",
      description="Retrieval evaluation (NDCG@10, Recall@10, MRR@10) of a "
                  "trained dpjax dual encoder.")
  p.add_argument("--model_dir", required=True,
                 help="a dual encoder run directory (python -m dpjax.train)")
  p.add_argument("--dataset", choices=sorted(DEFAULT_SPLITS), default="msmarco")
  p.add_argument("--data_dir", help="MSMARCO or BEIR directory (default: the "
                 "embedded MSMARCO / BEIR sample)")
  p.add_argument("--split", help="qrels split (default: dev for msmarco, test "
                 "for beir)")
  p.add_argument("--output_dir", help="default: MODEL_DIR/retrieval/<dataset>-<split>")
  p.add_argument("--top_k", type=int, default=100)
  p.add_argument("--shard_size", type=int, default=10_000)
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--backend", choices=search.BACKENDS, default="device",
                 help="exact search with JAX on the default devices, or numpy")
  p.add_argument("--doc_length", type=int, default=msmarco_tasks.TASK_FEATURE_LENGTHS["inputs"])
  p.add_argument("--query_length", type=int,
                 default=msmarco_tasks.TASK_FEATURE_LENGTHS["targets"])
  p.add_argument("--vocabulary", help="SentencePiece model (default: the "
                 "checkpoint's tokenizer, else the embedded sample's)")
  p.add_argument("--run_name", default="dpjax")
  return p


def load_dataset(name: str, data_dir: str | None, split: str) -> ir_data.IRDataset:
  """Loads split `split` of MSMARCO or of a BEIR-format dataset.

  Args:
    name: 'msmarco', else a BEIR-format dataset.
    data_dir: The dataset's directory; None: the embedded sample's.
    split: The split to load.
  """
  if name == "msmarco":
    return ir_data.load_msmarco(data_dir or msmarco.DEFAULT_SAMPLE_DIR, split)
  return ir_data.load_beir(data_dir or beir.SAMPLE_DIR, split)


def _dual_encoder(model_dir: str, vocabulary: str | None, mesh):
  """(encode_fn, tokenizer, fingerprint) of a trained dual encoder run."""
  config, params, meta = inference.load_trained(model_dir)
  vocabulary = (vocabulary or meta.tokenizer_files.get("sentencepiece")
                or msmarco_tasks.DEFAULT_VOCABULARY_PATH)
  encode_fn = encoding.device_encode_fn(
      lambda p, tokens: dual_encoder.encode(config, p, tokens), params, mesh)
  fingerprint = {"model_dir": os.path.abspath(model_dir), "step": meta.step,
                 "vocabulary": os.path.abspath(vocabulary)}
  return encode_fn, encoding.Tokenizer(vocabulary), fingerprint


def main(argv: list[str] | None = None) -> dict:
  """Runs `python -m dpjax.eval.retrieval`; returns the results."""
  args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
  for flag in ("top_k", "shard_size", "batch_size", "doc_length", "query_length"):
    if getattr(args, flag) < 1:
      raise errors.UsageError(f"--{flag} must be positive")
  split = args.split or DEFAULT_SPLITS[args.dataset]
  dataset = load_dataset(args.dataset, args.data_dir, split)  # fail fast on data
  mesh = partitioning.make_mesh()
  dp = partitioning.data_parallel_size(mesh)
  batch_size = -(-args.batch_size // dp) * dp
  encode_fn, tokenizer, fingerprint = _dual_encoder(args.model_dir, args.vocabulary,
                                                    mesh)
  output_dir = args.output_dir or os.path.join(
      args.model_dir, "retrieval", dataset.name.replace("/", "-"))
  return evaluate_retrieval(
      dataset, encode_fn, tokenizer, output_dir, fingerprint=fingerprint,
      doc_length=args.doc_length, query_length=args.query_length,
      batch_size=batch_size, shard_size=args.shard_size, top_k=args.top_k,
      backend=args.backend, run_name=args.run_name, mesh=mesh)


USER_ERRORS = (errors.UsageError, FileNotFoundError, ir_data.MalformedLineError,
               ir_data.DatasetError)


def cli(argv: list[str] | None = None) -> dict:
  """`main`, with a user error (bad flag, missing file, malformed line, empty
  dataset) printed as one `error: ...` line and exit status 2."""
  return gin_cli.exit_on_user_error(lambda: main(argv), USER_ERRORS)


if __name__ == "__main__":
  cli()
