"""DP-SGD accounting from the command line.

  python -m dpjax.privacy calibrate --epsilon 8 --delta 1e-5 \
      --sampling_rate 0.01 --steps 1000 [--accountant rdp|pld]
  python -m dpjax.privacy epsilon --noise_multiplier 1.1 --delta 1e-5 \
      --dataset_size 50000 --batch_size 500 --epochs 10

Each prints one JSON line. `--dataset_size N --batch_size B --epochs E` may
replace `--sampling_rate` and `--steps` (q = B / N, steps = ceil(E N / B)).
Invalid input prints a one-line error on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from dpjax.privacy import accounting


class _Parser(argparse.ArgumentParser):
  """Reports usage errors on a single line (argparse prints usage too)."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> _Parser:
  parser = _Parser(prog="python -m dpjax.privacy", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True,
                                   parser_class=_Parser)
  calibrate = commands.add_parser(
      "calibrate", help="noise multiplier for a target epsilon")
  calibrate.add_argument("--epsilon", type=float, required=True)
  eps = commands.add_parser("epsilon", help="epsilon of a noise multiplier")
  eps.add_argument("--noise_multiplier", type=float, required=True)
  for sub in (calibrate, eps):
    sub.add_argument("--delta", type=float, required=True)
    sub.add_argument("--sampling_rate", type=float)
    sub.add_argument("--steps", type=int)
    sub.add_argument("--dataset_size", type=int)
    sub.add_argument("--batch_size", type=int)
    sub.add_argument("--epochs", type=float)
    sub.add_argument("--accountant", choices=accounting.ACCOUNTANTS,
                     default="pld")
  return parser


def _rate_and_steps(args) -> tuple[float, int]:
  direct = (args.sampling_rate, args.steps)
  by_epochs = (args.dataset_size, args.batch_size, args.epochs)
  if all(v is not None for v in direct) and all(v is None for v in by_epochs):
    return args.sampling_rate, args.steps
  if all(v is not None for v in by_epochs) and all(v is None for v in direct):
    n, b, epochs = by_epochs
    if n < 1 or b < 1 or not epochs > 0:
      raise ValueError("dataset_size, batch_size and epochs must be positive.")
    return b / n, math.ceil(epochs * n / b)
  raise ValueError("give either --sampling_rate and --steps, or "
                   "--dataset_size, --batch_size and --epochs.")


def _json_float(x: float) -> float | str:
  return x if math.isfinite(x) else str(x)


def main(argv: list[str] | None = None) -> None:
  """Runs `python -m dpjax.privacy`."""
  parser = _parser()
  args = parser.parse_args(argv)
  try:
    q, steps = _rate_and_steps(args)
    if args.command == "calibrate":
      sigma = accounting.dpsgd_noise_multiplier(
          args.epsilon, args.delta, q, steps, args.accountant)
    else:
      sigma = args.noise_multiplier
    eps = accounting.dpsgd_epsilon(sigma, q, steps, args.delta,
                                   args.accountant)
  except ValueError as e:
    parser.error(str(e))
  result = {"command": args.command, "noise_multiplier": sigma,
            "epsilon": _json_float(eps), "delta": args.delta,
            "sampling_rate": q, "steps": steps, "accountant": args.accountant}
  if args.command == "calibrate":
    result["target_epsilon"] = _json_float(args.epsilon)
  print(json.dumps(result, allow_nan=False))


if __name__ == "__main__":
  sys.exit(main())
