"""`python -m dpjax.bench.sample_comparison`: DP-LoRA against full DP
fine-tuning, and adaptive clipping against a grid of fixed bounds, on the
embedded MSMARCO-format sample, from one pretrained start.

  python -m dpjax.bench.sample_comparison --work_dir=runs/comparison [--steps=60]

The start: the quickstart's, the shipped tiny T5 pretrained with span
corruption on the public world (tasks/data/pretrained/msmarco_t5). Every
run DP fine-tunes it on the sample's train split (the private data) with
the quickstart's settings (q = 256/2998, `--steps` steps, PLD) but the
paper's fine-tuning learning rate (Adam at 1e-3, not the quickstart's 1e-2)
and reports the eval loss on its validation split (dev queries about
entities of neither training set), as `python -m dpjax.train` computes it:

  full vs LoRA   ε = 3 and ε = 8; full fine-tuning clips at C = 0.1, LoRA
                 trains rank-8 adapters on q, k, v, o (α = 16) at C = 0.1;
  adaptive       at ε = 3, full fine-tuning with train.clip_norm =
                 'adaptive' (from 0.1, median target) against fixed C in
                 {0.01, 0.1, 1.0}.

Each run is its own `python -m dpjax.train` process; the table is printed
in markdown (and written to WORK_DIR/comparison.md) with the pretrained
start's own eval loss for reference. On 2 CPU cores the whole set takes
about 30-40 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# The paper's fine-tuning learning rate (gin/msmarco_query_generation.gin).
PAPER_LR = ["LEARNING_RATE = 1e-3"]
LORA = ["T5Config.lora = @LoRAConfig()", "LoRAConfig.rank = 8",
        "LoRAConfig.alpha = 16.0"]


def train(model_dir: str, steps: int | None, bindings: list[str],
          gin_file: str = "gin/quickstart.gin") -> dict:
  """One `python -m dpjax.train` on `gin_file` (`steps` steps, or the
  file's own), evaluated and checkpointed at its end; its summary, with
  the ledger's mechanism."""
  summary = os.path.join(model_dir, "train_summary.json")
  if not os.path.isfile(summary):  # a rerun of the script reuses finished runs
    once = steps or 10**9  # at the end only
    args = [sys.executable, "-m", "dpjax.train",
            f"--gin_file={gin_file}",
            f"--gin_bindings=MODEL_DIR = '{model_dir}'",
            *([f"--gin_bindings=TRAIN_STEPS = {steps}"] if steps else []),
            f"--gin_bindings=train.eval_period = {once}",
            "--gin_bindings=train.eval_examples = 512",
            "--gin_bindings=train.generate_after_training = False",
            f"--gin_bindings=train.checkpoint_period = {once}",
            *(f"--gin_bindings={b}" for b in bindings)]
    started = time.perf_counter()
    subprocess.run(args, cwd=REPO, check=True)
    print(f"[{time.perf_counter() - started:.0f} s] {model_dir}", flush=True)
  with open(summary) as f:
    result = json.load(f)
  with open(os.path.join(model_dir, "privacy_ledger.json")) as f:
    result["mechanism"] = json.load(f).get("mechanism", "dpsgd")
  return result


def _row(name: str, summary: dict, clip: str) -> list[str]:
  """A table row; `clip`: the fixed bound, or '' to print the adaptive
  bound of the last logged window."""
  return [name, f"{summary['eval_loss']:.4f}",
          f"{float(summary['epsilon_spent']):.3f}",
          f"{float(summary['noise_multiplier']):.4f}",
          clip or f"{summary['clip_norm']:.4g} (last)"]


def table(header: list[str], rows: list[list[str]]) -> str:
  """A markdown table of `header` and `rows`, ending in a newline."""
  lines = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" for _ in header) + " |"]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def run(work_dir: str, steps: int) -> str:
  """The comparison's table: `steps` of each private fine-tuning."""
  work_dir = os.path.abspath(work_dir)
  # The start's own loss on the private validation split: one step at a
  # learning rate of 0.
  unchanged = train(os.path.join(work_dir, "start_eval"), 1,
                     ["LEARNING_RATE = 0.0"])
  rows = [["public start (no private data)", f"{unchanged['eval_loss']:.4f}",
           "-", "-", "-"]]
  for eps in (3, 8):
    for name, extra in (("full", []), ("LoRA r=8", LORA)):
      summary = train(
          os.path.join(work_dir, f"{name[:4].strip()}_eps{eps}_{steps}"),
          steps, PAPER_LR + [f"TARGET_EPSILON = {eps}.0", *extra])
      rows.append(_row(f"{name}, ε = {eps}", summary, "0.1"))
  for c in (0.01, 0.1, 1.0):
    if c == 0.1:
      continue  # the full ε = 3 run above
    summary = train(os.path.join(work_dir, f"full_eps3_c{c}_{steps}"),
                    steps, PAPER_LR + ["TARGET_EPSILON = 3.0",
                                       f"CLIP_NORM = {c}"])
    rows.append(_row("full, ε = 3", summary, str(c)))
  summary = train(os.path.join(work_dir, f"full_eps3_adaptive_{steps}"),
                  steps, PAPER_LR + ["TARGET_EPSILON = 3.0",
                                     "train.clip_norm = 'adaptive'"])
  rows.append(_row("full, ε = 3, adaptive (from 0.1, median)", summary, ""))
  text = table(["run", "eval loss", "ε spent", "σ", "C"], rows)
  with open(os.path.join(work_dir, "comparison.md"), "w") as f:
    f.write(text)
  return text


def main(argv=None) -> int:
  """Runs `python -m dpjax.bench.sample_comparison`."""
  p = argparse.ArgumentParser(prog="python -m dpjax.bench.sample_comparison",
                              description=__doc__.splitlines()[0])
  p.add_argument("--work_dir", required=True)
  p.add_argument("--steps", type=int, default=60,
                 help="steps of each DP fine-tuning")
  args = p.parse_args(argv)
  print(run(args.work_dir, args.steps), end="")
  return 0


if __name__ == "__main__":
  sys.exit(main())
