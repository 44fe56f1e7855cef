"""`python -m dpjax.bench.mechanism_comparison`: BandMF against DP-SGD, and
user-level against example-level DP, on the embedded samples.

  python -m dpjax.bench.mechanism_comparison --work_dir=runs/comparison
      [--steps=300] [--only=bandmf|user_level]

BandMF vs DP-SGD: from the quickstart's pretrained start (the shipped tiny
T5 pretrained on the public world, tasks/data/pretrained/msmarco_t5), DP
fine-tuning on the MSMARCO-format sample at ε = 3 and 8 for the same
`--steps` steps of expected batch 64 (several epochs: the regime correlated
noise is for), clip 0.1, Adam at 1e-3 (and at ε = 3 plain SGD at 3.0): DP-SGD
with Poisson sampling against BandMF with its cyclic Poisson sampling and
the band count the plan chooses. Reported: the eval loss on the sample's
validation split.

User-level vs example-level: the tiny GPT-2 of gin/dialog_sample.gin (from
its pretrained start) trained on MultiDoGo conversations cut into 63-token
chunks (gin/dialog_sample_user_level.gin), ε = 8, 3 epochs: the conversation as the
unit (64 expected conversations a step, at most 4 chunks each, averaged)
against the chunk as the unit (Poisson sampling of as many chunks a step as
the user-level run takes on average). Reported: validation perplexity
(exp of the eval loss). One seed each; every run is its own
`python -m dpjax.train` process and is reused on a rerun.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from dpjax.bench.sample_comparison import PAPER_LR, table, train

DIALOG = "gin/dialog_sample_user_level.gin"


def bandmf_rows(work_dir: str, steps: int) -> list[list[str]]:
  """Trains DP-SGD and BandMF on the MSMARCO sample; their table rows.

  Args:
    work_dir: Where the runs are written (and reused on a rerun).
    steps: DP steps of every run.

  Returns:
    One row per run: name, optimizer, eval loss, ε spent, σ and bands.
  """
  private = PAPER_LR + [
      "BATCH_SIZE = 64", "CLIP_NORM = 0.1"]
  runs = [(eps, "Adam 1e-3", "") for eps in (3, 8)]
  # The paper's analysis is of SGD-type updates (prefix sums of the noisy
  # gradients); plain SGD at one learning rate, the same for both.
  runs.append((3, "SGD 3.0", "_sgd"))
  sgd = ["OPTIMIZER = 'sgd'", "LEARNING_RATE = 3.0"]
  rows = []
  for eps, optimizer, suffix in runs:
    for name, extra in (("DP-SGD", []),
                        ("BandMF", ["train.mechanism = 'bandmf'"])):
      summary = train(
          os.path.join(work_dir, f"{name}_eps{eps}_{steps}{suffix}"), steps,
          private + [f"TARGET_EPSILON = {eps}.0", *extra,
                     *(sgd if suffix else [])])
      mechanism = summary.get("mechanism", "dpsgd")
      bands = mechanism["bands"] if isinstance(mechanism, dict) else 1
      rows.append([f"{name}, ε = {eps}", optimizer,
                   f"{summary['eval_loss']:.4f}",
                   f"{float(summary['epsilon_spent']):.3f}",
                   f"{float(summary['noise_multiplier']):.4f}", str(bands)])
  return rows


def user_level_rows(work_dir: str) -> list[list[str]]:
  """Trains the dialog GPT-2 at user and at example level; their table rows.

  The example-level run takes the user-level run's steps and, as its batch,
  the user-level run's mean examples per step.

  Returns:
    One row per run: name, validation perplexity, ε spent, σ, steps and the
    unit of privacy.
  """
  common = ["train.eval_examples = 4096"]
  user = train(os.path.join(work_dir, "dialog_user_level"), None, common,
               gin_file=DIALOG)
  example = train(os.path.join(work_dir, "dialog_example_level"),
                  user["steps"], common + [
                      "train.privacy_unit = 'example'",
                      f"BATCH_SIZE = {round(user['examples_per_step'])}"],
                  gin_file=DIALOG)
  return [[name, f"{math.exp(s['eval_loss']):.2f}",
           f"{float(s['epsilon_spent']):.3f}",
           f"{float(s['noise_multiplier']):.4f}", str(s["steps"]), unit]
          for name, s, unit in (
              ("user-level (conversation)", user, "conversation"),
              ("example-level (chunk)", example, "63-token chunk"))]


def main(argv=None) -> int:
  """Runs `python -m dpjax.bench.mechanism_comparison`."""
  p = argparse.ArgumentParser(
      prog="python -m dpjax.bench.mechanism_comparison",
      description=__doc__.splitlines()[0])
  p.add_argument("--work_dir", required=True)
  p.add_argument("--steps", type=int, default=300,
                 help="DP steps of each BandMF / DP-SGD fine-tuning")
  p.add_argument("--only", choices=("bandmf", "user_level"))
  args = p.parse_args(argv)
  work_dir = os.path.abspath(args.work_dir)
  out = []
  if args.only in (None, "bandmf"):
    out.append(table(["run", "optimizer", "eval loss", "ε spent", "σ",
                      "bands"],
                     bandmf_rows(work_dir, args.steps)))
  if args.only in (None, "user_level"):
    out.append(table(["run", "validation perplexity", "ε spent", "σ",
                      "steps", "unit of privacy"], user_level_rows(work_dir)))
  text = "\n".join(out)
  with open(os.path.join(work_dir, "mechanisms.md"), "w") as f:
    f.write(text)
  print(text, end="")
  return 0


if __name__ == "__main__":
  sys.exit(main())
