"""SeqPATE's experiments (shared/papers/001).

  python -m dpjax.seqpate table1 --output_dir=runs/seqpate \\
      [--dataset=airdialogue|europarl] [--epsilon=3] [--seeds=0,1,2] \\
      [--partition=sample|user] [--num_teachers=64] [--max_queries=500] \\
      [--rows=SeqPATE,Pub-GPT,...] [--noisysgd_binding='EPOCHS = 10' ...]

Writes OUTPUT_DIR/DATASET/{results.jsonl,table1.md,table1.csv}
(OUTPUT_DIR/DATASET-user/ with --partition=user); rerunning
resumes (finished rows and trained models are reused). Defaults run the
embedded samples on a CPU (`dpjax.seqpate.experiment.Settings`).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from dpjax.seqpate import experiment


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m dpjax.seqpate")
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
  p.add_argument("--noisysgd_binding", action="append", default=[],
                 help="a gin binding for the NoisySGD trainer run over "
                      "gin/seqpate_noisysgd.gin (repeatable)")
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  settings = experiment.Settings()
  settings = dataclasses.replace(
      settings, epsilon=args.epsilon, partition=args.partition,
      num_teachers=args.num_teachers or settings.num_teachers,
      max_queries=args.max_queries or settings.max_queries,
      noisysgd_bindings=tuple(args.noisysgd_binding))
  result = experiment.table1(args.output_dir, dataset=args.dataset,
                             seeds=args.seeds, settings=settings,
                             rows=args.rows)
  with open(result["table_md"]) as f:
    print(f.read())
  return result


if __name__ == "__main__":
  main()
