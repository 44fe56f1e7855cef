"""`python -m dpjax.train`: DP training from gin files, t5x-style flags.

  python -m dpjax.train --gin_file=gin/msmarco_t5_xl_eps3.gin \\
      [--gin_file=G ...] [--gin.NAME=VALUE ...] [--gin_bindings='NAME = VALUE']
      [--dry_run [--dry_run_steps=K | --target=tpu:v5e:16x16]]

The work is done by `dpjax.training.trainer.train` on the run the gin files
describe (`dpjax.configurables`); this module parses the command line.
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import logging as absl_logging

from dpjax import configurables, errors, gin_cli
from dpjax.training import checkpoints, dry_run
from dpjax.data.readers import malformed
from dpjax.pretrained import hf
from dpjax.privacy import ledger as ledger_lib
import tasks  # noqa: F401  (the data layer's gin configurables)


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs `python -m dpjax.train`; returns the run's (or dry run's) result."""
  argv = list(sys.argv[1:] if argv is None else argv)
  absl_logging.set_verbosity(absl_logging.ERROR)  # dp-accounting's RDP chatter
  args, files, bindings = gin_cli.parse_args(
      argv, "DP fine-tuning with gin configuration (t5x-style flags).",
      add_arguments=_add_arguments)
  if args.dry_run or args.dry_run_steps:
    dry_run.use_memory_scheduler()  # before the backend starts
  gin_cli.configure(files, bindings, args.gin_search_paths)
  if args.target and not args.dry_run:
    raise errors.UsageError("--target plans a run for other devices: use it "
                             "with --dry_run")
  configurables.initialize()  # a multi-host job's: before any other JAX use
  if args.dry_run or args.dry_run_steps:
    config = configurables.run_config()
    configurables.register_tasks(config)
    return dry_run.dry_run(config, steps=args.dry_run_steps,
                           target=args.target)
  return configurables.train()


def _add_arguments(parser) -> None:
  parser.add_argument(
      "--dry_run", action="store_true",
      help="build everything the run would use, write nothing, and print "
           "its plan and compiled cost as one JSON line (dpjax.training.dry_run)")
  parser.add_argument(
      "--dry_run_steps", type=int, default=0, metavar="K",
      help="with --dry_run: also run K real steps (nothing is saved) and "
           "report the step time and the projected wall time of the run")
  parser.add_argument(
      "--target", metavar="tpu:GEN:TOPOLOGY",
      help="with --dry_run: plan and compile for a TPU slice from this host "
           "(e.g. tpu:v5e:16x16, tpu:v4:2x2x4; needs the [tpu] extra)")


def user_errors() -> tuple[type[Exception], ...]:
  """Errors caused by the user's input: reported in one message, exit 2."""
  return (errors.UsageError, FileNotFoundError, malformed.MalformedLineError,
          checkpoints.CheckpointMismatchError, ledger_lib.BudgetExceededError,
          hf.CheckpointError, checkpoints.UnreadableCheckpointError)


if __name__ == "__main__":
  gin_cli.run_command(main, user_errors())
