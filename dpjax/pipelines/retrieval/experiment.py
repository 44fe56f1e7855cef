"""The retrieval experiment of Carranza et al. (NAACL 2024) in one command.

  python -m dpjax.pipelines.retrieval --output_dir=runs/retrieval \\
      [--epsilons=3,8,16,inf] [--seeds=0] [--mechanisms=dpsgd] [--skip_canaries] \\
      [--canary_epsilons=16,inf] [--generator_gin=retrieval_experiment_sample.gin] \\
      [--dual_encoder_gin=dual_encoder_msmarco_sample.gin] \\
      [--gin.NAME=VALUE ...] [--generator_gin.NAME=VALUE ...] \\
      [--dual_encoder_gin.NAME=VALUE ...]

For each ε, seed and mechanism: a T5 document -> query generator DP
fine-tuned at ε (DP-SGD, or BandMF with `--mechanisms=dpsgd,bandmf`),
one synthetic query per training document (`inference.generate_synthetic`,
the gin's decoding: nucleus p = 0.8), a dual encoder trained WITHOUT DP on
the synthetic pairs (post-processing: ε is the generator's), and the
direct-DP dual encoder on the original pairs at the same ε
(`dual_encoder_msmarco_dp.gin`); once, the dual encoder on the original
pairs without DP (the ε = ∞ reference). Every dual encoder is evaluated on
the dev split (NDCG@10, Recall@10, MRR@10; `dpjax.eval.retrieval`), every
synthetic set scored (one-to-one BLEU, MAUVE, n-gram memorisation;
`dpjax.eval.text_quality`). MAUVE features: the reference dual encoder's
encoder (trained on the original pairs; on the sample no public pretrained
T5 exists to take them from).

Canary audit (`dpjax.pipelines.retrieval.canaries`; `--skip_canaries` to leave it
out): at `--canary_epsilons` (default 16 and ∞, the paper's Table 7), one
generator per ε trained on the data + canaries, separately from
the retrieval generators, as the paper does. Reusing the retrieval
generators would put the canaries (~10% of the rows on the sample) into
the synthetic training data and change n and δ of the runs compared.

Defaults run on the embedded MSMARCO sample (tiny T5s, CPU); full data:
`--data_dir=/data/msmarco --generator_gin=msmarco_t5_base_eps3.gin
--dual_encoder_gin=` (the ε binding of each run overrides the file's).
`--gin.` bindings go to every run, `--generator_gin.` and
`--dual_encoder_gin.` ones to that kind of run. Everything is resumable:
a rerun skips finished trainings, generations, evaluations and audits.

Outputs under --output_dir: results.jsonl, table.md, table.csv,
canaries.csv (with the audit), ndcg_vs_epsilon.png, and one directory per
run (original/, synthetic/eps*/seed*/, synthetic_bandmf/eps*/seed*/,
direct_dp/eps*/seed*/, canaries/).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
from typing import Sequence

import gin
import numpy as np

import tasks  # noqa: F401  (gin configurables of the data layer)
from dpjax import configurables
from dpjax import errors, fileio, gin_cli, verify
from dpjax.pipelines import harness
from dpjax.generation import inference
from dpjax.data.readers import msmarco
from dpjax.eval import encoding, retrieval
from dpjax.eval import text_quality as tq
from dpjax.pipelines.retrieval import canaries as canaries_lib
from dpjax.models import dual_encoder
from tasks import msmarco as msmarco_tasks

EPSILONS = (3.0, 8.0, 16.0, math.inf)
METRICS = ("ndcg@10", "recall@10", "mrr@10")
GENERATOR_GIN = ("retrieval_experiment_sample.gin",)
DUAL_ENCODER_OVERLAY = ("dual_encoder_msmarco_sample.gin",)
# With the default overlay: the sample's dual encoders in 2 epochs of
# 96-token passages (the grid's time budget; the paper's 5 epochs of 384).
SAMPLE_DUAL_ENCODER_BINDINGS = (
    "EPOCHS = 2", "TASK_FEATURE_LENGTHS = {'queries': 32, 'documents': 96}")
# Table 7 of the paper audits ε = 16 and ∞.
CANARY_EPSILONS = (16.0, math.inf)
MEMORIZATION_N = 4
# train.mechanism of the generators: the approach's name and its directory.
MECHANISMS = {"dpsgd": ("synthetic", "synthetic"),
              "bandmf": ("synthetic (BandMF)", "synthetic_bandmf")}


def _cached_json(path: str, compute, complete=lambda value: True):
  """The JSON value cached at `path`, or `compute()` written there; a cached
  value that is not `complete` (written before a field now needed was kept)
  is computed again."""
  if os.path.isfile(path):
    with open(path) as f:
      value = json.load(f)
    if complete(value):
      return value
  value = compute()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fileio.write_atomic(path, json.dumps(value, indent=1, default=str))
  return value


def _with_config(model_dir: str):
  """Gin as the run in `model_dir` was configured (data dir, decoding)."""
  gin.clear_config()
  gin_cli.configure([], [], run_files=[os.path.join(model_dir, "config.gin")])


def evaluate(model_dir: str, data_dir: str | None) -> dict:
  """Dev-split retrieval metrics of a dual encoder run (cached)."""
  out = os.path.join(model_dir, "retrieval")
  path = os.path.join(out, "metrics.json")
  if not os.path.isfile(path):
    # The run's lengths from its verified meta: `retrieval.main` loads the
    # params itself.
    lengths = verify.run_meta(model_dir)[1].task_feature_lengths
    retrieval.main(["--model_dir", model_dir, "--output_dir", out,
                    "--doc_length", str(lengths["documents"]),
                    "--query_length", str(lengths["queries"])]
                   + (["--data_dir", data_dir] if data_dir else []))
  with open(path) as f:
    metrics = json.load(f)
  return {m: metrics[m] for m in METRICS}


def _text_encoder(model_dir: str):
  """The queries' embeddings under a dual encoder run."""
  config, params, meta = inference.load_trained(model_dir)
  fn = encoding.device_encode_fn(
      lambda p, tokens: dual_encoder.encode(config, p, tokens), params)
  vocabulary = (meta.tokenizer_files.get("sentencepiece")
                or msmarco_tasks.DEFAULT_VOCABULARY_PATH)
  return encoding.TextEncoder(fn, encoding.Tokenizer(vocabulary),
                              meta.task_feature_lengths["queries"], 256)


def text_quality(synthetic_jsonl: str, data_dir: str | None,
                 feature_model_dir: str) -> dict:
  """BLEU, MAUVE and memorisation of a synthetic set (cached beside it)."""
  data_dir = data_dir or msmarco.DEFAULT_SAMPLE_DIR

  def run():
    synthetic, original = tq.one_to_one_pairs(synthetic_jsonl, data_dir)
    training = (q for _, q in msmarco.read_tsv_pairs(
        os.path.join(data_dir, "queries.train.tsv")))
    memo = tq.ngram_memorization(synthetic, training, (MEMORIZATION_N,))
    return {"bleu": tq.bleu_one_to_one(synthetic, original)["bleu"],
            "mauve": tq.encoder_mauve(_text_encoder(feature_model_dir),
                                      original, synthetic, seed=0),
            f"memorization@{MEMORIZATION_N}": memo[MEMORIZATION_N]}

  return _cached_json(os.path.join(os.path.dirname(synthetic_jsonl),
                                   "quality.json"), run)


def _privacy(model_dir: str) -> dict:
  ledger = verify.run_ledger(model_dir)
  return {"epsilon_spent": ledger.epsilon_spent(), "delta": ledger.delta}


def run_experiment(out_dir: str, *, epsilons: Sequence[float] = EPSILONS,
                   seeds: Sequence[int] = (0,),
                   mechanisms: Sequence[str] = ("dpsgd",),
                   generator_gin: Sequence[str] = GENERATOR_GIN,
                   dual_encoder_gin: Sequence[str] = DUAL_ENCODER_OVERLAY,
                   bindings: Sequence[str] = (),
                   generator_bindings: Sequence[str] = (),
                   dual_encoder_bindings: Sequence[str] = (),
                   data_dir: str | None = None,
                   canary_epsilons: Sequence[float] = CANARY_EPSILONS,
                   canaries_per_cell: int = 2,
                   canary_repetitions: Sequence[int] = canaries_lib.REPETITIONS,
                   num_candidates: int = 1000) -> dict:
  """Runs the grid (resumably); writes the tables and the plot; returns
  `{"rows", "canaries", "table_md", "plot"}`."""
  unknown = set(mechanisms) - set(MECHANISMS)
  if unknown or not mechanisms:
    raise errors.UsageError(f"mechanisms are a non-empty subset of "
                             f"{sorted(MECHANISMS)}, got {list(mechanisms)}")
  root = os.path.abspath(out_dir)
  data = [] if data_dir is None else [f"MSMARCO_DIR = {data_dir!r}"]
  gen_bind = [*bindings, *data, *generator_bindings]
  de_bind = [*bindings, *data, *dual_encoder_bindings]
  de_files = ("dual_encoder_msmarco.gin", *dual_encoder_gin)
  dp_files = ("dual_encoder_msmarco_dp.gin", *dual_encoder_gin)

  def generator_run(run_dir: str, eps: float, bindings=gen_bind, **fields):
    harness.train_run(run_dir, generator_gin, bindings, target_epsilon=eps,
                      generate_after_training=False, **fields)

  reference = os.path.join(root, "original", "dual_encoder")
  harness.train_run(reference, de_files, de_bind, target_epsilon=math.inf)
  rows = [dict(approach="original", epsilon=math.inf, seed=0,
               **_privacy(reference), **evaluate(reference, data_dir))]
  for eps in epsilons:
    for seed in seeds:
      for mechanism in mechanisms:
        if mechanism != "dpsgd" and math.isinf(eps):
          continue  # no noise to correlate: the ε = ∞ generator is DP-SGD's
        approach, folder = MECHANISMS[mechanism]
        run_dir = os.path.join(root, folder, f"eps{harness.eps_name(eps)}",
                               f"seed{seed}")
        generator = os.path.join(run_dir, "generator")
        generator_run(generator, eps, seed=seed, mechanism=mechanism)
        synthetic = os.path.join(run_dir, "synthetic")
        if not os.path.isfile(os.path.join(synthetic, "synthetic.jsonl")):
          _with_config(generator)  # its generate_synthetic.* bindings
          configurables.generate_synthetic(model_dir=generator,
                                           output_dir=synthetic, seed=seed)
        dual = os.path.join(run_dir, "dual_encoder")
        harness.train_run(dual, de_files, [
            *de_bind, f"TRAIN_PAIRS_DIR = {synthetic!r}",
            "TRAIN_PAIRS_SPLIT = 'synthetic'"], target_epsilon=math.inf,
                          seed=seed)
        rows.append(dict(
            approach=approach, epsilon=eps, seed=seed, **_privacy(generator),
            **evaluate(dual, data_dir),
            **text_quality(os.path.join(synthetic, "synthetic.jsonl"),
                           data_dir, reference)))
      if math.isinf(eps):
        continue
      direct = os.path.join(root, "direct_dp", f"eps{harness.eps_name(eps)}",
                            f"seed{seed}")
      harness.train_run(direct, dp_files, de_bind, target_epsilon=eps,
                        seed=seed)
      rows.append(dict(approach="direct DP", epsilon=eps, seed=seed,
                       **_privacy(direct), **evaluate(direct, data_dir)))

  audit_rows = []
  if canary_epsilons:
    canary_data = os.path.join(root, "canaries", "data")
    inserted = canaries_lib.insert_canaries(
        data_dir or msmarco.DEFAULT_SAMPLE_DIR, canary_data,
        per_cell=canaries_per_cell, repetitions=canary_repetitions)
    for eps in canary_epsilons:
      generator = os.path.join(root, "canaries", f"eps{harness.eps_name(eps)}")
      generator_run(generator, eps,
                    [*gen_bind, f"MSMARCO_DIR = {canary_data!r}"])
      privacy = _privacy(generator)
      per_canary = _cached_json(
          os.path.join(generator, "audit.json"),
          lambda: canaries_lib.audit(generator, inserted,
                                     num_candidates=num_candidates),
          # Audits from before the one-run bounds lack a candidate's score.
          complete=lambda rows: all("candidate_score" in r for r in rows))
      audit_rows += [dict(epsilon=eps, **privacy, **r)
                     for r in canaries_lib.summarize(
                         per_canary, delta=privacy["delta"],
                         num_candidates=num_candidates)]
  return write_outputs(root, rows, audit_rows)


def write_outputs(root: str, rows: list[dict], audit_rows: list[dict]) -> dict:
  """results.jsonl, table.md, table.csv, canaries.csv, ndcg_vs_epsilon.png."""
  harness.write_results(
      os.path.join(root, harness.RESULTS_FILENAME),
      [dict(r, kind="retrieval") for r in rows]
      + [dict(r, kind="canaries") for r in audit_rows])
  groups = collections.OrderedDict()
  for r in rows:
    groups.setdefault((r["approach"], r["epsilon"]), []).append(r)
  quality = ("bleu", "mauve", f"memorization@{MEMORIZATION_N}")
  header = ["approach", "ε", *(m.upper() for m in METRICS),
            "BLEU", "MAUVE", f"mem@{MEMORIZATION_N}", "ε spent", "seeds"]
  table = []
  for (approach, eps), group in groups.items():
    spent = max(g["epsilon_spent"] for g in group)
    table.append([approach, harness.eps_name(eps),
                  *(harness.mean_std([g[m] for g in group]) for m in METRICS),
                  *(harness.mean_std([g.get(q) for g in group]) for q in quality),
                  "∞" if math.isinf(spent) else f"{spent:.3f}",
                  str(len(group))])
  notes = ["NDCG@10 / Recall@10 / MRR@10 on the dev split; BLEU "
           "(sacrebleu, 0-100) and MAUVE of the synthetic queries against "
           "the original ones; mem@4: fraction of synthetic 4-grams found in "
           "the training queries. mean ± std over seeds."]
  canary_header = ["ε", "repetitions", "kind", "canaries", "rank (of R+1)",
                   "exposure", "exposure (skew-normal)", "extracted",
                   "extracted (greedy)", "ε lower bound",
                   "ε lower bound (one run, group of 2r)"]
  canary_table = [[harness.eps_name(r["epsilon"]), str(r["repetitions"]), r["kind"],
                   str(r["canaries"]), f"{r['sample_rank']:.1f}",
                   f"{r['exposure']:.2f}", f"{r['exposure_skewnorm']:.2f}",
                   f"{r['extraction']:.2f}", f"{r['extraction_greedy']:.2f}",
                   *(f"{r[k]:.4f}" if k in r else "" for k in (
                       "epsilon_lower_bound", "epsilon_lower_bound_one_run"))]
                  for r in audit_rows]
  if audit_rows:
    notes.append("\n".join([
        "# Canary exposure (paper Table 7)", "",
        *fileio.markdown_table(canary_header, canary_table), "",
        "Secret at the end of the canary query; rank among the "
        "true secret and R random 10-digit secrets by the generator's "
        "log-likelihood; exposure = log2(1e10) - log2(estimated rank); "
        "ε lower bound per example from the attack 'no sampled secret "
        "beats it' (95% Clopper–Pearson, group privacy over 2 x "
        "repetitions add/remove steps; dpjax/pipelines/retrieval/canaries.py). "
        "ε lower bound (one run, group of 2r): jax-privacy's f-DP one-run "
        "estimator (Mahloujifar et al.; the dialog membership study's) on "
        "the true secrets' scores against one candidate's each, at 95% and "
        "the ledger's δ; the ε of a canary's 2r examples as a group (r = "
        "repetitions), a comparable statistic, not a certified bound (a "
        "pair's coins are tied)."]))
    fileio.write_csv(os.path.join(root, "canaries.csv"), canary_header,
                     canary_table)
  md = os.path.join(root, "table.md")
  text = harness.write_table(
      table, header, md, os.path.join(root, "table.csv"),
      title="Retrieval on DP synthetic queries vs direct DP training "
            "(paper Tables 3, 4, 6)", notes=notes)
  plot = os.path.join(root, "ndcg_vs_epsilon.png")
  original = groups.get(("original", math.inf))
  harness.plot_vs_epsilon(
      {approach: {e: float(np.mean([g["ndcg@10"] for g in group]))
                  for (a, e), group in groups.items() if a == approach}
       for approach in (*(a for a, _ in MECHANISMS.values()), "direct DP")},
      plot, "NDCG@10 (dev)", references={
          "original pairs, no DP": original[0]["ndcg@10"]} if original else {})
  print(text, end="", flush=True)
  return {"rows": rows, "canaries": audit_rows, "table_md": md, "plot": plot}


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def _add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--output_dir", required=True)
  p.add_argument("--epsilons", default="3,8,16,inf",
                 type=harness.parse_epsilons)
  p.add_argument("--seeds", default="0",
                 type=lambda s: [int(x) for x in s.split(",")])
  p.add_argument("--mechanisms", default="dpsgd",
                 type=lambda s: [x for x in s.split(",") if x],
                 help="generators' train.mechanism: dpsgd, bandmf or both")
  p.add_argument("--data_dir", default=None,
                 help="MSMARCO directory (default: the embedded sample)")
  p.add_argument("--skip_canaries", action="store_true")
  p.add_argument("--canary_epsilons", default="16,inf",
                 type=harness.parse_epsilons)
  p.add_argument("--canaries_per_cell", type=int, default=2,
                 help="canaries per (kind, repetitions)")
  p.add_argument("--num_candidates", type=int, default=1000,
                 help="random secrets the canary's is ranked against")


def _run(args, gin_files, bindings) -> dict:
  if gin_files:
    raise errors.UsageError("use --generator_gin / --dual_encoder_gin")
  dual_encoder_bindings = args.dual_encoder_gin_bindings
  if args.dual_encoder_gin_file is None:
    dual_encoder_bindings = [*SAMPLE_DUAL_ENCODER_BINDINGS,
                             *dual_encoder_bindings]
  return run_experiment(
      args.output_dir, epsilons=args.epsilons, seeds=args.seeds,
      mechanisms=args.mechanisms,
      generator_gin=tuple(args.generator_gin_file or GENERATOR_GIN),
      dual_encoder_gin=tuple(f for f in (args.dual_encoder_gin_file
                                         or DUAL_ENCODER_OVERLAY) if f),
      bindings=bindings, generator_bindings=args.generator_gin_bindings,
      dual_encoder_bindings=dual_encoder_bindings, data_dir=args.data_dir,
      canary_epsilons=() if args.skip_canaries else args.canary_epsilons,
      canaries_per_cell=args.canaries_per_cell,
      num_candidates=args.num_candidates)


def main(argv=None) -> dict:
  """Generator gin files: `--generator_gin=FILE` (default GENERATOR_GIN);
  the dual encoders': `--dual_encoder_gin=FILE` after
  dual_encoder_msmarco[_dp].gin (default DUAL_ENCODER_OVERLAY; '' for none);
  `--generator_gin.NAME=VALUE`, `--dual_encoder_gin.NAME=VALUE`: bindings of
  that kind of run."""
  return harness.run_command(
      argv, "The retrieval experiment of Carranza et al. (NAACL 2024, arXiv "
      "2305.05973).", _add_arguments, _run, extra_prefixes=("generator_gin", "dual_encoder_gin"))
