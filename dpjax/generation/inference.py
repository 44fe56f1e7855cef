"""Synthetic query generation from a trained model directory.

Run by
  python -m dpjax.infer --model_dir=/runs/xl_eps3 [--top_p=0.8] [--top_k=0]
      [--temperature=1.0] [--greedy] [--output_dir=DIR] [--limit=N]

One query per training document (the task's train split, one row per distinct
passage), sampled with the KV-cached decoder (dpjax.generation.decoding) batched over the
device mesh. Writes MSMARCO-format files, so the output is a drop-in training
set for a retriever:
  queries.synthetic.tsv   qid \\t query
  qrels.synthetic.tsv     qid \\t 0 \\t pid \\t 1
  synthetic.jsonl         one record per document's sample with provenance
                          (model dir, step, ε spent, δ, decoding settings)
A sample that is empty (EOS first) is recorded in synthetic.jsonl only: an
MSMARCO query has text, and the readers refuse an empty one.
Generation is post-processing of a DP model: it spends no privacy budget.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from dpjax.training import checkpoints, partitioning
from dpjax.generation import decoding
from dpjax import errors, fileio, verify
from dpjax.models import t5, trainable


def load_trained(model_dir: str):
  """(config, params, `checkpoints.RunMeta`) of the newest checkpoint in
  model_dir that reads back whole, authenticated and verified
  (`verify.newest`: a run whose ledger fails a check is refused); newer ones
  that do not read back are named on the console and skipped, as training
  skips them."""
  mngr = (checkpoints.manager(model_dir, create=False)
          if os.path.isdir(os.path.join(model_dir, "checkpoints")) else None)
  try:
    if mngr is None or not mngr.all_steps():
      raise FileNotFoundError(
          f"no checkpoint under {model_dir}/checkpoints: train a model there "
          "first (python -m dpjax.train)")
    _, meta, params = verify.newest(mngr, verify.meta_key(model_dir),
                                    params=True)
  finally:
    if mngr is not None:
      mngr.close()
  return trainable.config_from_json(meta.model_class,
                                    meta.model_config), params, meta


def check_decoding_args(*, top_p, top_k, temperature, greedy, batch_size,
                        limit=None, max_decode_length=None,
                        prefix: str = "generate_synthetic.") -> None:
  """Refuses decoding settings outside their ranges with a UsageError naming
  the setting (`prefix`: "--" for `dpjax.infer`'s flags, else gin's
  `generate_synthetic.`): top_p in (0, 1], temperature > 0 unless greedy,
  top_k >= 0, batch_size >= 1, limit and max_decode_length None or >= 1."""
  number, integer = errors.is_number, errors.is_int

  def refuse(name, want, got):
    raise errors.UsageError(f"{prefix}{name} must be {want}, got {got!r}")

  if not number(top_p) or not 0 < top_p <= 1:
    refuse("top_p", "in (0, 1] (1: no nucleus truncation)", top_p)
  if not integer(top_k) or top_k < 0:
    refuse("top_k", "an integer >= 0 (0: no top-k truncation)", top_k)
  if not greedy and (not number(temperature) or
                     not 0 < temperature < float("inf")):
    refuse("temperature", f"> 0 (or use {prefix}greedy)", temperature)
  if not integer(batch_size) or batch_size < 1:
    refuse("batch_size", "a positive integer", batch_size)
  if limit is not None and (not integer(limit) or limit < 1):
    refuse("limit", "a positive integer (or unset: every document)", limit)
  if max_decode_length is not None and (not integer(max_decode_length)
                                        or max_decode_length < 1):
    refuse("max_decode_length", "a positive integer or None",
           max_decode_length)


def generate_synthetic(*, model_dir: str, output_dir: str | None = None,
                       top_p: float = 0.8, top_k: int = 0,
                       temperature: float = 1.0, greedy: bool = False,
                       batch_size: int = 128, max_decode_length: int | None = None,
                       seed: int = 0, limit: int | None = None,
                       register_tasks: Callable[[dict], Any] | None = None
                       ) -> dict:
  """Writes one synthetic query per training document; returns the paths.
  `register_tasks(tokenizer_files)`: registers the run's seqio task with
  the tokenizer files it recorded, before its data is read (the command
  line's part: the engine imports no task definitions)."""
  check_decoding_args(top_p=top_p, top_k=top_k, temperature=temperature,
                      greedy=greedy, batch_size=batch_size, limit=limit,
                      max_decode_length=max_decode_length)
  # Lazy: the arrays import TensorFlow; loading a run needs none.
  from dpjax.data import arrays as data_arrays
  start = time.perf_counter()
  model_dir = os.path.abspath(model_dir)
  config, params, meta = load_trained(model_dir)
  if not isinstance(config, t5.T5Config):
    raise errors.UsageError(f"{model_dir} holds a {type(config).__name__} "
                            "run; synthetic queries need a T5 model")
  if register_tasks is not None:
    register_tasks(meta.tokenizer_files)
  task_name = meta.mixture_or_task_name
  lengths = meta.task_feature_lengths
  max_len = max_decode_length or lengths["targets"]
  inputs, info = data_arrays.load_task_inputs(task_name, "train",
                                              lengths["inputs"])
  if limit:
    inputs, info = inputs[:limit], info[:limit]
  import seqio
  vocab = seqio.get_mixture_or_task(task_name).output_features[
      "targets"].vocabulary

  mesh = partitioning.make_mesh()
  data = mesh.shape.get("data", 1)
  # No wider than the inputs (a `limit` below the batch decodes no padding
  # rows), and a multiple of the data axis.
  batch_size = max(1, -(-min(batch_size, len(inputs)) // data)) * data
  sharding = partitioning.batch_sharding(mesh, 2)
  settings = dict(top_p=top_p, top_k=top_k, temperature=temperature,
                  greedy=greedy, max_length=max_len, seed=seed)
  run = jax.jit(lambda p, x, rng: decoding.generate(
      config, p, x, max_length=max_len, rng=rng, temperature=temperature,
      top_k=top_k, top_p=top_p, greedy=greedy))
  outputs = []
  for b, s in enumerate(range(0, len(inputs), batch_size)):
    chunk = inputs[s:s + batch_size]
    padded = np.zeros((batch_size, chunk.shape[1]), chunk.dtype)
    padded[:len(chunk)] = chunk
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), b)
    tokens = np.asarray(run(params, jax.device_put(padded, sharding), rng))
    outputs.extend(tokens[:len(chunk)])

  ledger = meta.privacy_ledger()
  provenance = {"model_dir": model_dir, "step": meta.step,
                "epsilon": ledger.epsilon_spent(), "delta": ledger.delta,
                "target_epsilon": ledger.target_epsilon, "decoding": settings}
  out = os.path.abspath(output_dir or os.path.join(model_dir, "synthetic"))
  os.makedirs(out, exist_ok=True)
  queries, qrels, records = [], [], []
  for qid, (tokens, row) in enumerate(zip(outputs, info)):
    ids = [int(t) for t in tokens]
    ids = ids[:ids.index(1)] if 1 in ids else ids
    text = " ".join(vocab.decode(ids).split())  # TSV-safe: no tabs/newlines
    records.append(json.dumps({"qid": qid, "pid": row["pid"], "query": text,
                               **provenance}) + "\n")
    if text:  # an empty sample (EOS first) is no query: MSMARCO has none
      queries.append(f"{qid}\t{text}\n")
      qrels.append(f"{qid}\t0\t{row['pid']}\t1\n")
  empty = len(records) - len(queries)
  paths = {name: os.path.join(out, name) for name in
           ("queries.synthetic.tsv", "qrels.synthetic.tsv", "synthetic.jsonl")}
  fileio.write_atomic(paths["queries.synthetic.tsv"], "".join(queries))
  fileio.write_atomic(paths["qrels.synthetic.tsv"], "".join(qrels))
  fileio.write_atomic(paths["synthetic.jsonl"], "".join(records))
  seconds = time.perf_counter() - start
  dropped = f", {empty} empty samples left out" if empty else ""
  print(f"dpjax: wrote {len(queries)} synthetic queries to {out} "
        f"({seconds:.1f}s; model ε spent {provenance['epsilon']:.4f}, "
        f"δ={ledger.delta:.3g}{dropped})", flush=True)
  return {"output_dir": out, "num_queries": len(queries), "empty": empty,
          "seconds": seconds, **paths}
