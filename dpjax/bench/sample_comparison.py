"""`python -m dpjax.bench.sample_comparison`: DP-LoRA against full DP
fine-tuning, and adaptive clipping against a grid of fixed bounds, on the
embedded MSMARCO-format sample, from one pretrained start.

  python -m dpjax.bench.sample_comparison --work_dir=/tmp/cmp [--steps=150]
      [--finetune_steps=60]

The start: the quickstart's tiny T5 trained without privacy (ε = ∞, no
clipping) on a public world, the sample generator's world for another seed
(`tasks.msmarco_sample.generate --seed`: the same templates, other invented
entities, tokenized with the sample's SentencePiece model), then exported
to Hugging Face layout (`dpjax.export`) so that every run starts from the
same weights through INITIAL_CHECKPOINT_PATH. Every run then DP fine-tunes
on the sample's train split (the private data) with the quickstart's
settings (q = 256/2998, `--finetune_steps` steps, PLD) but the paper's
fine-tuning learning rate (Adam at 1e-3, not the quickstart's 1e-2) and
reports the eval loss on its validation split (dev queries about entities
of neither training set), as `python -m dpjax.train` computes it:

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
PUBLIC_SEED = 7
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


def pretrained_start(work_dir: str, steps: int) -> list[str]:
  """The shared start (made once in `work_dir`: `steps` of public
  pretraining, exported to HF) as the bindings of a private fine-tuning
  from it."""
  public = os.path.join(work_dir, "public_world")
  if not os.path.isdir(public):
    subprocess.run([sys.executable, "-m", "tasks.msmarco_sample.generate",
                    f"--output_dir={public}", f"--seed={PUBLIC_SEED}",
                    "--no_spm"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
  train(os.path.join(work_dir, "pretrain"), steps, [
      f"MSMARCO_DIR = '{public}'", "TARGET_EPSILON = 'inf'",
      "CLIP_NORM = 1e10"])
  start = os.path.join(work_dir, "start_hf")
  if not os.path.isdir(start):
    subprocess.run([sys.executable, "-m", "dpjax.export",
                    f"--model_dir={os.path.join(work_dir, 'pretrain')}",
                    f"--output_dir={start}"], cwd=REPO, check=True)
  # Fine-tuning at the paper's learning rate (gin/msmarco_query_generation.gin),
  # not the quickstart's from-scratch 1e-2.
  return [f"INITIAL_CHECKPOINT_PATH = '{start}'", "LEARNING_RATE = 1e-3"]


def table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" for _ in header) + " |"]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def run(work_dir: str, steps: int, finetune_steps: int | None = None) -> str:
  """The comparison's table: `steps` of public pretraining, then
  `finetune_steps` (default `steps`) of each private fine-tuning."""
  tune = finetune_steps or steps
  work_dir = os.path.abspath(work_dir)
  private = pretrained_start(work_dir, steps)
  # The start's own loss on the private validation split: one step at a
  # learning rate of 0.
  unchanged = train(os.path.join(work_dir, "start_eval"), 1,
                     private + ["LEARNING_RATE = 0.0"])
  rows = [["public start (no private data)", f"{unchanged['eval_loss']:.4f}",
           "-", "-", "-"]]
  for eps in (3, 8):
    for name, extra in (("full", []), ("LoRA r=8", LORA)):
      summary = train(
          os.path.join(work_dir, f"{name[:4].strip()}_eps{eps}_{tune}"),
          tune, private + [f"TARGET_EPSILON = {eps}.0", *extra])
      rows.append(_row(f"{name}, ε = {eps}", summary, "0.1"))
  for c in (0.01, 0.1, 1.0):
    if c == 0.1:
      continue  # the full ε = 3 run above
    summary = train(os.path.join(work_dir, f"full_eps3_c{c}_{tune}"), tune,
                     private + ["TARGET_EPSILON = 3.0", f"CLIP_NORM = {c}"])
    rows.append(_row("full, ε = 3", summary, str(c)))
  summary = train(os.path.join(work_dir, f"full_eps3_adaptive_{tune}"), tune,
                   private + ["TARGET_EPSILON = 3.0",
                              "train.clip_norm = 'adaptive'"])
  rows.append(_row("full, ε = 3, adaptive (from 0.1, median)", summary, ""))
  text = table(["run", "eval loss", "ε spent", "σ", "C"], rows)
  with open(os.path.join(work_dir, "comparison.md"), "w") as f:
    f.write(text)
  return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m dpjax.bench.sample_comparison",
                              description=__doc__.splitlines()[0])
  p.add_argument("--work_dir", required=True)
  p.add_argument("--steps", type=int, default=150,
                 help="steps of public pretraining (and of fine-tuning)")
  p.add_argument("--finetune_steps", type=int,
                 help="steps of each DP fine-tuning (default --steps)")
  args = p.parse_args(argv)
  print(run(args.work_dir, args.steps, args.finetune_steps), end="")
  return 0


if __name__ == "__main__":
  sys.exit(main())
