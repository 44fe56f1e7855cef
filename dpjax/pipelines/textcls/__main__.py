"""The label-conditioned generation experiments of an ICLR 2023 submission,
OpenReview LUql3ZOFwFD.

  python -m dpjax.pipelines.textcls table4 --output_dir=runs/textcls \\
      [--epsilons=3,8,16,256,inf] [--gin_file=textcls_sample.gin] [--gin.NAME=VALUE ...]
  python -m dpjax.pipelines.textcls table1 --output_dir=runs/textcls [--step_size=0.04] \\
      [--samples_per_class=N] [--head_epochs=E]

Both share the multitask runs (`OUTPUT_DIR/runs/multitask_eps*`) and
`results.jsonl`; rerunning skips what is done. table1 also trains the
baseline pipeline per ε (`runs/baseline_lm_eps*`, then the post-hoc head
`runs/baseline_disc_eps*`, one budget over both; `--head_epochs`: the head's
training length, default as many steps as the LM). Defaults run on the embedded
SST-2 sample (tiny models, CPU); the paper's settings are
`--gin_file=textcls_distilgpt2.gin` with the full data and a pretrained
distilgpt2 (see that file).
"""
from __future__ import annotations

import argparse
import dataclasses

from dpjax.pipelines import harness
from dpjax.pipelines.textcls import experiment


def _add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("table", choices=["table1", "table4"])
  p.add_argument("--output_dir", required=True)
  p.add_argument("--epsilons", default="3,8,16,256,inf",
                 type=harness.parse_epsilons)
  p.add_argument("--step_size", type=float, default=None, help="PPLM step size")
  p.add_argument("--samples_per_class", type=int, default=None,
                 help="default: as many as the training set has")
  p.add_argument("--head_epochs", type=float, default=None,
                 help="epochs of the baselines' post-hoc head (default: as many "
                 "steps as the LM; both share one (ε, δ))")


def _run(args, gin_files, bindings):
  files = gin_files or experiment.DEFAULT_GIN_FILES
  if args.table == "table4":
    return experiment.table4(args.output_dir, epsilons=args.epsilons,
                             gin_files=files, bindings=bindings)
  settings = experiment.Settings(samples_per_class=args.samples_per_class,
                                 head_epochs=args.head_epochs)
  if args.step_size is not None:
    settings = dataclasses.replace(settings, step_size=args.step_size)
  return experiment.table1(args.output_dir, epsilons=args.epsilons,
                           gin_files=files, bindings=bindings,
                           settings=settings)


def main(argv=None):
  """Runs `python -m dpjax.pipelines.textcls`."""
  return harness.run_command(
      argv, "Tables 1 and 4 of DP conditional text generation.",
      _add_arguments, _run)


if __name__ == "__main__":
  harness.command_main(main)
