"""`python -m dpjax.audit`: an empirical ε lower bound for a configured run,
from one training run with canaries.

  python -m dpjax.audit --gin_file=quickstart.gin [--gin.NAME=VALUE ...] \\
      --output_dir=D [--canaries=N] [--kind=gradient|input] \\
      [--confidence=0.95]

Trains the run the gin files describe (into D/run, a fresh run: its own
secret, its own ledger) with N canaries, each included by a secret fair
coin, scores each canary, and prints one JSON line: the run's ε (its
ledger) beside the ε lower bound the scores prove at the confidence, with
the estimator and the threat model.
  gradient  (white box) Dirac directions in parameter space added to the
            clipped sums of the steps that sample them
            (`dpjax.audit.canaries`), scored from every step's release
            (`dpjax.audit.scores`); D also gets those releases at the
            canary and control coordinates (observations.npy).
  input     (black box) training examples of random target tokens
            (`dpjax.audit.inputs`; the run's split gains N rows), scored by
            the final model's loss on them.
D gets the line (audit.json), the scores and coins (scores.csv: written
after training) and the scores' in/out histograms (scores.png).

A lower bound above the run's ε refutes the run's guarantee (with
probability at least the confidence, it is not a chance result); one far
below it says the audit could not see more, not that the run leaks less:
one-run audits of subsampled DP-SGD sit well below its ε.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
from typing import Sequence

from absl import logging as absl_logging
import numpy as np

from dpjax import configurables, errors, gin_cli, train as train_cli
from dpjax.audit import canaries as canaries_lib, inputs as inputs_lib
from dpjax.audit import evidence, scores as scores_lib
from dpjax.generation import inference
from dpjax.models import trainable
from dpjax.pipelines import harness
from dpjax.privacy import ledger as ledger_lib, secret as secret_lib
from dpjax.training import plan as plan_lib, reporting, run_config, trainer

KINDS = ("gradient", "input")
THREAT_MODELS = {
    "gradient": "white box: every DP step's release (the privatized "
                "gradient), read at the canary and control coordinates",
    "input": "black box: the final model's loss on each canary example, "
             "no intermediate release",
}
# Default canary counts per kind, least first: the first whose perfectly
# separated scores prove the run's target ε (`default_count`). Input
# canaries are training rows, so fewer (1,000 prove ε ≥ 8.5 at 95%).
DEFAULT_COUNTS = {"gradient": (10_000, 100_000), "input": (1_000, 10_000)}


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs `python -m dpjax.audit`; returns the audit's JSON line as a dict."""
  argv = list(sys.argv[1:] if argv is None else argv)
  absl_logging.set_verbosity(absl_logging.ERROR)
  args, files, bindings = gin_cli.parse_args(
      argv, "An empirical ε lower bound from one training run with canaries.",
      add_arguments=_add_arguments)
  _check(args)
  output_dir = os.path.abspath(os.path.expanduser(args.output_dir))
  run_dir = os.path.join(output_dir, evidence.RUN_DIRNAME)
  gin_cli.configure(files, [*bindings, f"MODEL_DIR = {run_dir!r}"],
                    args.gin_search_paths)
  configurables.initialize()
  config = dataclasses.replace(configurables.run_config(),
                               generate_after_training=False)
  configurables.register_tasks(config)

  chosen = {}

  def count_for(delta: float) -> int:
    if args.canaries is not None:
      return args.canaries
    return default_count(run_config.as_float(config.target_epsilon), delta,
                         args.confidence, DEFAULT_COUNTS[args.kind])

  def canaries(model, plan):
    count = count_for(plan.delta)
    if args.canaries is None:
      available = canaries_lib.trained_coordinates(model) // 2
      if count > available:
        reporting.say(f"the model trains {2 * available} coordinates: "
                      f"{available} canaries and as many controls")
        count = available
    chosen["canaries"] = canaries_lib.choose(
        model, count, canaries_lib.participation(plan.sampler), config.seed)
    chosen["plan"] = plan
    return chosen["canaries"]

  def added_rows(train, noise_secret):
    # The count is sized on δ of the split before the canaries.
    delta = plan_lib.resolve_delta(config.delta,
                                   len(next(iter(train.values()))))
    chosen["inputs"] = inputs_lib.choose(train, count_for(delta), config.seed)
    return chosen["inputs"].added(noise_secret)

  recorder = canaries_lib.Recorder()
  gradient = args.kind == "gradient"
  result = trainer.train(
      config, config_text=lambda: configurables.config_text(config),
      canaries=canaries if gradient else None,
      added_rows=None if gradient else added_rows,
      callbacks=[recorder] if gradient else [])
  if result["steps_done"] < result["steps"]:
    raise errors.UsageError(
        f"the audit run stopped at step {result['steps_done']} of "
        f"{result['steps']}: an audit is one uninterrupted run; start it "
        "again in a fresh --output_dir")
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(run_dir, ledger_lib.LEDGER_FILENAME))
  if gradient:
    canaries_ = chosen["canaries"]
    observations = recorder.observations()
    np.save(os.path.join(output_dir, "observations.npy"), observations)
    # Correlated noise (BandMF) names its strategy C; independent noise none.
    strategy = getattr(chosen["plan"].mechanism, "strategy", None)
    canary_scores = scores_lib.scores(
        observations, canaries_.groups(), ledger.noise_multiplier,
        canaries_.participation,
        None if strategy is None else strategy.matrix())
  else:
    canaries_ = chosen["inputs"]
    model_config, params, _ = inference.load_trained(run_dir)
    batch_loss = trainable.trainable(model_config,
                                     config.task_feature_lengths).batch_loss
    canary_scores = inputs_lib.scores(batch_loss, params, canaries_)
  return _report(output_dir, run_dir, canaries_.count, canary_scores, ledger,
                 result, args)


def default_count(epsilon: float, delta: float, confidence: float,
                  counts: Sequence[int]) -> int:
  """The first of `counts` with which canaries scored in perfect order
  (every one in above every one out) prove `epsilon` at `confidence`: a
  mechanism that leaks all it may can then show it (ε = ∞: the first)."""
  for count in counts:
    half = np.ones(count // 2)
    if math.isinf(epsilon) or scores_lib.lower_bound(
        np.concatenate([half, 0 * half]),
        np.arange(2 * (count // 2)) < count // 2, delta=delta,
        confidence=confidence)["epsilon_lower_bound"] >= epsilon:
      return count
  return counts[-1]


def _report(output_dir: str, run_dir: str, count: int,
            canary_scores: np.ndarray, ledger: ledger_lib.PrivacyLedger,
            result: dict, args) -> dict:
  """Coins and bound: the files in `output_dir` and the JSON line."""
  coins = np.asarray(canaries_lib.coins(
      secret_lib.RunSecret.load(run_dir).noise_key(), count))
  bound = scores_lib.lower_bound(canary_scores, coins, delta=ledger.delta,
                                 confidence=args.confidence)
  line = {
      "epsilon": result["epsilon_spent"],
      "delta": ledger.delta,
      **bound,
      "estimator": scores_lib.ESTIMATOR,
      "confidence": args.confidence,
      "canaries": count,
      "canaries_in": int(coins.sum()),
      "kind": args.kind,
      "threat_model": THREAT_MODELS[args.kind],
      "mechanism": ledger.mechanism,
      "noise_multiplier": ledger.noise_multiplier,
      "sampling": ledger.sampling,
      "dp_steps": ledger.steps,
      "run_dir": run_dir,
  }
  with open(os.path.join(output_dir, evidence.SCORES_FILE), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["canary", "score", "in"])
    writer.writerows((i, repr(float(s)), int(c))
                     for i, (s, c) in enumerate(zip(canary_scores, coins)))
  _plot(canary_scores, coins, line, os.path.join(output_dir, "scores.png"))
  with open(os.path.join(output_dir, evidence.AUDIT_LINE), "w") as f:
    json.dump(line, f, indent=1)
  print(json.dumps(line), flush=True)
  return line


def _plot(canary_scores, coins, line: dict, path: str) -> None:
  """The in and out canaries' score histograms, the bound in the title."""
  plt = harness.pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.5))
  bins = np.histogram_bin_edges(canary_scores, bins=60)
  ax.hist(canary_scores[~coins], bins=bins, alpha=0.6, label="out")
  ax.hist(canary_scores[coins], bins=bins, alpha=0.6, label="in")
  ax.set_yscale("log")
  ax.set_xlabel("score (log-likelihood ratio, in vs out)")
  ax.set_ylabel("canaries")
  ax.set_title(f"ε = {line['epsilon']:.3g}; audited ε ≥ "
               f"{line['epsilon_lower_bound']:.3g} "
               f"({line['confidence']:.0%}, {line['canaries']} canaries)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _check(args) -> None:
  """One UsageError for bad flags, before anything is read or written."""
  if args.canaries is not None and args.canaries < 2:
    raise errors.UsageError(f"--canaries must be at least 2, got "
                             f"{args.canaries}")
  if args.kind not in KINDS:
    raise errors.UsageError(f"--kind must be one of {KINDS}, got "
                             f"{args.kind!r}")
  if not 0 < args.confidence < 1:
    raise errors.UsageError(f"--confidence must be in (0, 1), got "
                             f"{args.confidence}")
  if os.path.exists(os.path.expanduser(args.output_dir)):
    raise errors.UsageError(
        f"--output_dir {args.output_dir} exists: an audit trains a fresh run "
        "(its own secret and coins); give a new directory")


def _add_arguments(parser) -> None:
  parser.add_argument("--output_dir", required=True, metavar="D",
                      help="a new directory: the audit run (D/run), its "
                           "scores, coins, plot and JSON line")
  parser.add_argument("--canaries", type=int, default=None, metavar="N",
                      help="canaries (default: the least of "
                           f"{DEFAULT_COUNTS} for the kind that can show "
                           "the run's ε; gradient: at most half the trained "
                           "coordinates)")
  parser.add_argument("--kind", default="gradient",
                      help=f"canary kind: {' | '.join(KINDS)}")
  parser.add_argument("--confidence", type=float, default=0.95,
                      help="the bound's confidence (default 0.95)")


if __name__ == "__main__":
  gin_cli.run_command(main, train_cli.user_errors())
