"""t5x-style gin command line: --gin_file, --gin_bindings, --gin.NAME=VALUE.

  python -m dpjax.train --gin_file=gin/quickstart.gin \\
      --gin.TRAIN_STEPS=100 --gin.MODEL_DIR="'/tmp/run'" \\
      --gin_bindings='train.log_period = 5'

`--gin.NAME=VALUE` becomes the binding `NAME = VALUE`. VALUE is a gin value
(Python literal, @reference or %MACRO); as a convenience a VALUE that is none
of these is taken as a string, so --gin.MODEL_DIR=/tmp/run works unquoted.
"""
from __future__ import annotations

import argparse
import ast
import logging
import os
import sys

import gin

REPO_GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "gin")


class UsageError(ValueError):
  """Bad command line or configuration; reported as one line, exit status 2."""


def _as_gin_value(value: str) -> str:
  stripped = value.strip()
  if stripped.startswith(("@", "%", "(", "[", "{")):
    return value
  try:
    ast.literal_eval(stripped)
    return value
  except (ValueError, SyntaxError):
    return repr(value)


def parse_args(argv: list[str], description: str, add_arguments=None
               ) -> tuple[argparse.Namespace, list[str], list[str]]:
  """Returns (parsed args, gin files, gin bindings).

  `add_arguments(parser)` may add a command's own flags.
  """
  parser = argparse.ArgumentParser(description=description)
  if add_arguments:
    add_arguments(parser)
  parser.add_argument("--gin_file", action="append", default=[],
                      help="gin config file (repeatable); searched in the "
                           "working directory, --gin_search_paths and gin/")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="a gin binding 'NAME = VALUE' (repeatable)")
  parser.add_argument("--gin_search_paths", action="append", default=[],
                      help="extra directories to search for gin files")
  bindings: list[str] = []
  rest: list[str] = []
  for arg in argv:
    if arg.startswith("--gin."):
      name, sep, value = arg[len("--gin."):].partition("=")
      if not sep:
        raise UsageError(f"{arg}: expected --gin.NAME=VALUE")
      bindings.append(f"{name} = {_as_gin_value(value)}")
    else:
      rest.append(arg)
  args = parser.parse_args(rest)
  return args, args.gin_file, args.gin_bindings + bindings


def configure(gin_files: list[str], bindings: list[str],
              search_paths: list[str] = ()) -> None:
  """Parses gin files and bindings; every problem becomes a UsageError."""
  for path in [os.getcwd(), *search_paths, REPO_GIN_DIR]:
    gin.add_config_file_search_path(path)
  for f in gin_files:
    if not any(os.path.isfile(os.path.join(p, f))
               for p in [os.getcwd(), *search_paths, REPO_GIN_DIR]) \
        and not os.path.isfile(f):
      raise UsageError(f"gin file not found: {f} (searched the working "
                       f"directory, {', '.join(search_paths) or 'no extra paths'}"
                       f" and {REPO_GIN_DIR})")
  logging.disable(logging.ERROR)  # gin logs every search-path miss
  try:
    gin.parse_config_files_and_bindings(gin_files, bindings,
                                        finalize_config=False)
  except (ValueError, KeyError, IOError, SyntaxError) as e:
    raise UsageError(f"gin: {' '.join(str(e).split())}") from e
  finally:
    logging.disable(logging.NOTSET)


def exit_on_user_error(fn, user_errors=(UsageError,)):
  """Runs fn(); a user error (bad flag, file, line, budget) prints a clear
  message and exits with status 2 instead of a traceback."""
  try:
    return fn()
  except user_errors as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except RuntimeError as e:  # gin: a required binding was not provided
    if "Required bindings" not in str(e) and "gin" not in str(e).lower():
      raise
    print(f"error: gin: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
