"""`python -m dpjax.pretrain`: the command line of `dpjax.pretrain.pretrain`
(kept apart so gin sees one `pretrain`)."""
from __future__ import annotations

import sys
from typing import Sequence

import gin

from dpjax import gin_cli, pretrain, train


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs `python -m dpjax.pretrain`."""
  args, files, bindings = gin_cli.parse_args(
      list(sys.argv[1:] if argv is None else argv),
      "Non-private pretraining on a public corpus, released as a Hugging "
      "Face checkpoint.", add_arguments=_add_arguments)
  gin_cli.configure(files, bindings, args.gin_search_paths)
  if args.output_dir:
    gin.bind_parameter("pretrain.output_dir", args.output_dir)
  result = pretrain.pretrain(verify=args.verify)
  if result.get("mismatched"):
    sys.exit(1)
  return result


def _add_arguments(parser) -> None:
  parser.add_argument("--output_dir", help="where the release goes (default: "
                      "the gin file's pretrain.output_dir)")
  parser.add_argument("--verify", action="store_true",
                      help="rebuild from scratch in a temporary directory and "
                           "compare with OUTPUT_DIR's SHA256SUMS (exit 1 on a "
                           "mismatch)")


if __name__ == "__main__":
  gin_cli.run_command(main, train.user_errors())
