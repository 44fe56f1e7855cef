"""The semantic-parse experiments of Mireshghallah et al., ACL 2023, arXiv
2212.10520, one command each.

Table 1 (synthetic-utterance quality by method and ε):

  python -m dpjax.pipelines.semparse generation --output_dir=runs/semparse \\
      [--dataset=treedst|smcalflow] [--epsilons=3,8,16,inf] [--seeds=0] \\
      [--methods=1-stage,1.5-stage,2-stage] [--epochs=2,8] \\
      [--gin_file=semparse_sample.gin] [--gin.NAME=VALUE ...]

Table 3 (adding a missing functionality to a parser from DP synthetic data):

  python -m dpjax.pipelines.semparse adaptation --output_dir=runs/semparse \\
      [--dataset=smcalflow] [--missing=weather|eod] [--epsilon=3] [--seeds=0]

Defaults run on the embedded samples (tiny models, CPU). With the full
datasets: `--gin_file=semparse_gpt2.gin
--gin.register_semparse_tasks.treedst_dir="'/data/treedst'"` (and a
pretrained GPT-2 via INITIAL_CHECKPOINT_PATH). Gin flags apply to the DP
GPT-2 runs; the T5 parsers are configured apart, by the same conventions
with the prefix `parser_gin`: `--parser_gin_file=FILE` (the high-resource
parser's, default semparse_t5_parser.gin), `--parser_gin.NAME=VALUE` and
`--parser_gin_bindings='NAME = VALUE'` (every parser).
"""
from __future__ import annotations

import argparse

from dpjax.pipelines import harness
from dpjax.pipelines.semparse import experiments


def _add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("experiment", choices=["generation", "adaptation"])
  p.add_argument("--output_dir", required=True)
  p.add_argument("--dataset", default=None, choices=["treedst", "smcalflow"],
                 help="default: treedst (generation), smcalflow (adaptation)")
  p.add_argument("--missing", default="weather", choices=["weather", "eod"])
  p.add_argument("--epsilon", default="3", type=harness.parse_epsilons,
                 help="adaptation: the generators' ε")
  p.add_argument("--epsilons", default="3,8,16,inf",
                 type=harness.parse_epsilons)
  p.add_argument("--seeds", default="0",  # the paper's three: 0,1,2
                 type=lambda s: [int(x) for x in s.split(",")])
  p.add_argument("--methods", default=None, type=lambda s: s.split(","))
  p.add_argument("--epochs", default="2,8", type=harness.parse_epsilons,
                 help="T1,T2: parse-LM and parse->utterance epochs")
  p.add_argument("--num_samples", type=int, default=None)
  p.add_argument("--feature_model_dir", default=None)


def _run(args, gin_files, bindings) -> dict:
  gin_files = gin_files or ("semparse_sample.gin",)
  parser = dict(parser_bindings=args.parser_gin_bindings)
  if args.parser_gin_file:
    parser["parser_gin_files"] = args.parser_gin_file
  if args.experiment == "adaptation":
    return experiments.adaptation_table(
        args.output_dir, dataset=args.dataset or "smcalflow",
        missing=args.missing, epsilon=args.epsilon[0], seed=args.seeds[0],
        methods=args.methods or ("1-stage", "2-stage"),
        epochs=tuple(args.epochs), gin_files=gin_files, bindings=bindings,
        num_synthetic=args.num_samples, **parser)
  return experiments.generation_table(
      args.output_dir, dataset=args.dataset or "treedst", methods=args.methods,
      epsilons=args.epsilons, seeds=args.seeds, epochs=tuple(args.epochs),
      gin_files=gin_files, bindings=bindings, num_samples=args.num_samples,
      feature_model_dir=args.feature_model_dir, **parser)


def main(argv=None) -> dict:
  """Runs `python -m dpjax.pipelines.semparse`."""
  return harness.run_command(
      argv, "The semantic-parse experiments of dpjax.", _add_arguments, _run,
      extra_prefixes=("parser_gin",))


if __name__ == "__main__":
  harness.command_main(main)
