"""SeqPATE's experiments (Tian et al., NeurIPS 2022).

  python -m dpjax.pipelines.seqpate table1 --output_dir=runs/seqpate \\
      [--dataset=airdialogue|europarl] [--epsilon=3] [--seeds=0,1,2] \\
      [--partition=sample|user] [--num_teachers=64] [--max_queries=500] \\
      [--rows=SeqPATE,Pub-GPT,...] [--initial_checkpoint=DIR|none] \\
      [--gin_file=seqpate_noisysgd.gin] [--gin.NAME=VALUE ...]

Gin flags configure the NoisySGD rows' trainer runs (default gin file
gin/seqpate_noisysgd.gin; model, ε, δ, seed and data are bound from the
settings), e.g. `--gin.EPOCHS=10`. Writes
OUTPUT_DIR/DATASET/{results.jsonl,table1.md,table1.csv}
(OUTPUT_DIR/DATASET-user/ with --partition=user); rerunning
resumes (finished rows and trained models are reused). Defaults run the
embedded samples on a CPU (`dpjax.pipelines.seqpate.experiment.Settings`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from dpjax.pipelines import harness
from dpjax.pipelines.seqpate import experiment


def _add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("command", choices=["table1"])
  p.add_argument("--output_dir", required=True)
  p.add_argument("--dataset", default="airdialogue",
                 choices=experiment.DATASETS)
  p.add_argument("--epsilon", type=float, default=3.0)
  p.add_argument("--seeds", default="0",
                 type=lambda s: [int(x) for x in s.split(",")])
  p.add_argument("--partition", default="sample", choices=["sample", "user"])
  p.add_argument("--num_teachers", type=int, default=None)
  p.add_argument("--max_queries", type=int, default=None)
  p.add_argument("--rows", default=None, type=lambda s: s.split(","),
                 help="comma-separated row names (default: all)")
  p.add_argument("--initial_checkpoint", default=None,
                 help="Hugging Face GPT-2 directory Pub-GPT starts from "
                 "(default: the shipped tasks/data/pretrained/seqpate_gpt2; "
                 "'none': random weights)")


def _run(args, gin_files, bindings) -> dict:
  settings = experiment.Settings()
  settings = dataclasses.replace(
      settings, epsilon=args.epsilon, partition=args.partition,
      num_teachers=args.num_teachers or settings.num_teachers,
      max_queries=args.max_queries or settings.max_queries,
      initial_checkpoint=(settings.initial_checkpoint
                          if args.initial_checkpoint is None else
                          None if args.initial_checkpoint.lower() == "none"
                          else os.path.abspath(args.initial_checkpoint)),
      noisysgd_gin_files=tuple(gin_files or settings.noisysgd_gin_files),
      # Binding strings, as tables made with --noisysgd_binding saved them.
      noisysgd_bindings=tuple(str(b) for b in bindings))
  result = experiment.table1(args.output_dir, dataset=args.dataset,
                             seeds=args.seeds, settings=settings,
                             rows=args.rows)
  with open(result["table_md"]) as f:
    print(f.read())
  return result


def main(argv=None) -> dict:
  """Runs `python -m dpjax.pipelines.seqpate`."""
  return harness.run_command(argv, "SeqPATE's experiments (Table 1).",
                             _add_arguments, _run)


if __name__ == "__main__":
  harness.command_main(main)
