"""`python -m dpjax.infer`: synthetic queries from a trained model directory.

  python -m dpjax.infer --model_dir=runs/quickstart [--top_p=0.8] [--top_k=0]
      [--temperature=1.0] [--greedy] [--output_dir=DIR] [--limit=N]
      [--gin.NAME=VALUE ...]

The run's own config.gin (data directory, vocabulary) is read from the model
directory first; see `dpjax.generation.inference.generate_synthetic` for the outputs.
"""
from __future__ import annotations

import argparse
import os
import sys

from dpjax import configurables, gin_cli, train
from dpjax.generation import inference
import tasks  # noqa: F401  (gin configurables of the data layer)


def _add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model_dir", required=True)
  p.add_argument("--output_dir")
  p.add_argument("--top_p", type=float, default=0.8)
  p.add_argument("--top_k", type=int, default=0)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--greedy", action="store_true")
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--limit", type=int, help="only the first N documents")


def main(argv=None) -> dict:
  """Runs `python -m dpjax.infer`; returns `generate_synthetic`'s result."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args, files, bindings = gin_cli.parse_args(
      argv, "Generate synthetic queries from a trained dpjax model directory.",
      _add_arguments)
  inference.check_decoding_args(
      top_p=args.top_p, top_k=args.top_k, temperature=args.temperature,
      greedy=args.greedy, batch_size=args.batch_size, limit=args.limit,
      prefix="--")
  config_gin = os.path.join(args.model_dir, "config.gin")
  gin_cli.configure(files, bindings, args.gin_search_paths,
                    run_files=[config_gin] if os.path.isfile(config_gin)
                    else [])
  return configurables.generate_synthetic(
      model_dir=args.model_dir, output_dir=args.output_dir, top_p=args.top_p,
      top_k=args.top_k, temperature=args.temperature, greedy=args.greedy,
      batch_size=args.batch_size, seed=args.seed, limit=args.limit)


def user_errors() -> tuple[type[Exception], ...]:
  """The trainer's user errors (bad flag, file, data line, checkpoint)."""
  return train.user_errors()


if __name__ == "__main__":
  gin_cli.run_command(main, user_errors())
