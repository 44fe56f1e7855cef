"""t5x-style gin command line: --gin_file, --gin_bindings, --gin.NAME=VALUE.

  python -m dpjax.train --gin_file=gin/quickstart.gin \\
      --gin.TRAIN_STEPS=100 --gin.MODEL_DIR="'runs/quickstart'" \\
      --gin_bindings='train.log_period = 5'

`--gin.NAME=VALUE` becomes the binding `NAME = VALUE`. VALUE is a gin value
(Python literal, @reference or %MACRO); as a convenience a VALUE that is none
of these is taken as a string, so --gin.MODEL_DIR=runs/quickstart works unquoted.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import logging
import os
import re
import sys
import tokenize

import gin

from dpjax import errors
from dpjax.training import reporting

REPO_GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "gin")


class _Binding(str):
  """A gin binding that remembers the flag it came from (for messages)."""
  flag: str


def _binding(text: str, flag: str) -> _Binding:
  b = _Binding(text)
  b.flag = flag
  return b


def _as_gin_value(value: str) -> str:
  stripped = value.strip()
  if stripped.startswith(("@", "%", "(", "[", "{")):
    return value
  try:
    ast.literal_eval(stripped)
    return value
  except (ValueError, SyntaxError):
    return repr(value)


def parse_args(argv: list[str], description: str, add_arguments=None,
               extra_prefixes: tuple[str, ...] = ()
               ) -> tuple[argparse.Namespace, list[str], list[str]]:
  """Returns (parsed args, gin files, gin bindings).

  `add_arguments(parser)` may add a command's own flags. Each of
  `extra_prefixes` (e.g. "parser_gin") is a second gin configuration, for
  runs configured apart from the main ones, with the same conventions:
  `--P_file` or `--P` (repeatable; args.P_file, None if not given) and
  `--P.NAME=VALUE` / `--P_bindings` (args.P_bindings).
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
  for prefix in extra_prefixes:
    parser.add_argument(f"--{prefix}_file", f"--{prefix}", action="append",
                        default=None, dest=f"{prefix}_file",
                        help=f"gin config file of the {prefix} runs "
                             "(repeatable)")
    parser.add_argument(f"--{prefix}_bindings", action="append", default=[],
                        help=f"a gin binding of the {prefix} runs "
                             f"(repeatable; or --{prefix}.NAME=VALUE)")
  dotted = {prefix: [] for prefix in ("gin", *extra_prefixes)}
  rest: list[str] = []
  for arg in argv:
    prefix = next((p for p in dotted if arg.startswith(f"--{p}.")), None)
    if prefix is None:
      rest.append(arg)
      continue
    name, sep, value = arg[len(prefix) + 3:].partition("=")
    if not sep:
      raise errors.UsageError(f"{arg}: expected --{prefix}.NAME=VALUE")
    dotted[prefix].append(
        _binding(f"{name} = {_as_gin_value(value)}", arg))
  args = parser.parse_args(rest)
  for prefix in extra_prefixes:
    setattr(args, f"{prefix}_bindings",
            _flag_bindings(getattr(args, f"{prefix}_bindings"), prefix)
            + dotted[prefix])
  return (args, args.gin_file,
          _flag_bindings(args.gin_bindings, "gin") + dotted["gin"])


def _flag_bindings(texts: list[str], prefix: str) -> list[_Binding]:
  return [_binding(b, f"--{prefix}_bindings={b!r}") for b in texts]


# gin appends where an error happened ("In call to configurable 'train'
# (<function ...>)", "In bindings string line 1", the offending line); the
# messages here name it themselves.
_GIN_CONTEXT = re.compile(r"\n\s*In (call to configurable|bindings string|file)"
                          r"\b.*", re.DOTALL)


def _gin_reason(e: BaseException, line: bool = False) -> str:
  """One line saying why gin could not parse something (`line`: with the
  line number of a syntax error)."""
  if isinstance(e, tokenize.TokenError):
    return "unexpected end of input: an unclosed bracket or string"
  if isinstance(e, SyntaxError) and e.msg:
    return (f"{e.msg.rstrip('.')} (line {e.lineno})"
            if line and e.lineno is not None else e.msg.rstrip("."))
  return " ".join(_GIN_CONTEXT.sub("", str(e)).split())


def _gin_file_error(path: str, e: BaseException) -> str:
  """`gin: FILE:LINE: why` (the included file's, where gin says which)."""
  if isinstance(e, SyntaxError) and e.msg and e.lineno is not None:
    where = e.filename if e.filename and e.filename != "<unknown>" else path
    return f"gin: {where}:{e.lineno}: {e.msg.rstrip('.')}"
  reason = _gin_reason(e)
  if isinstance(e, OSError):
    reason = (f"cannot read {e.filename or path}: {e.strerror}" if e.strerror
              else reason.split(" Searched config paths")[0].rstrip("."))
  where = re.search(r'In file "([^"]*)", line (\d+)', str(e))
  if where:
    return f"gin: {where.group(1)}:{where.group(2)}: {reason}"
  return f"gin: in {path}: {reason}"


# Where the modules a run's config.gin may import lived before dpjax's
# layout of packages: such a file imports them by their old names.
_MOVED_MODULES = {
    **{f"dpjax.{m}": f"dpjax.training.{m}" for m in (
        "checkpoints", "distributed", "dry_run", "loop", "padding",
        "partitioning", "plan", "prefetch", "reporting", "run_config",
        "sizing", "step_cost", "targets", "trainer")},
    **{f"dpjax.{m}": "dpjax.training.step" for m in (
        "steps", "train_step", "training.steps", "training.train_step")},
    **{f"dpjax.privacy.{m}": f"dpjax.privacy.mechanisms.{m}"
       for m in ("adaptive_clipping", "bandmf", "redaction_schedule")},
    **{f"dpjax.{m}": f"dpjax.generation.{m}"
       for m in ("decoding", "pplm", "inference")},
    **{f"dpjax.{m}": f"dpjax.pipelines.{m}" for m in (
        "harness", "text_classifier", "dialog.classifier")},
}


def _alias_moved_modules(path: str) -> None:
  """Makes the old names of moved modules that `path` imports importable."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError):
    return  # parse_config_file reports it
  for old, new in _MOVED_MODULES.items():
    if old not in sys.modules and re.search(
        rf"^\s*import\s+{re.escape(old)}(\s|$)", text, re.M):
      sys.modules[old] = importlib.import_module(new)


def configure(gin_files: list[str], bindings: list[str],
              search_paths: list[str] = (), *,
              run_files: list[str] = ()) -> None:
  """Parses gin files and bindings; every problem becomes a UsageError.

  `run_files`: config.gin files a dpjax run wrote (`MODEL_DIR/config.gin`),
  parsed first; one written before dpjax's modules moved to their packages
  imports them by their old names, which resolve to the new ones."""
  for path in [os.getcwd(), *search_paths, REPO_GIN_DIR]:
    gin.add_config_file_search_path(path)
  files = [*run_files, *gin_files]
  for f in files:
    if not any(os.path.isfile(os.path.join(p, f))
               for p in [os.getcwd(), *search_paths, REPO_GIN_DIR]) \
        and not os.path.isfile(f):
      raise errors.UsageError(
          f"gin file not found: {f} (searched the working directory, "
          f"{', '.join(search_paths) or 'no extra paths'} and {REPO_GIN_DIR})")
  logging.disable(logging.ERROR)  # gin logs every search-path miss
  # One file, then one binding, at a time: an error names the file and line,
  # or the binding as the user wrote it (gin numbers the lines of all the
  # bindings joined, which are no lines of the user's).
  gin_errors = (ValueError, KeyError, OSError, SyntaxError, ImportError,
                tokenize.TokenError)
  try:
    for path in files:
      try:
        if path in run_files:
          _alias_moved_modules(path)
        gin.parse_config_file(path)
      except gin_errors as e:
        raise errors.UsageError(_gin_file_error(path, e)) from None
    for binding in bindings:
      try:
        gin.parse_config(binding)
      except gin_errors as e:
        flag = getattr(binding, "flag", None) or f"binding {str(binding)!r}"
        raise errors.UsageError(
            f"gin: in {flag}: "
            f"{_gin_reason(e, line=chr(10) in binding.strip())}") from None
  finally:
    logging.disable(logging.NOTSET)


def error_message(e: BaseException) -> str:
  """An exception's message without the context gin appends to it; an
  OSError's as `strerror: filename` (no errno)."""
  text = _GIN_CONTEXT.sub("", str(e)).strip()
  if isinstance(e, OSError):
    text = re.sub(r"^\[Errno -?\d+\] ", "", text)
  return text or type(e).__name__


def run_command(fn, user_errors=(errors.UsageError,)):
  """A command's `__main__`: libraries' log records and teardown tracebacks
  kept off the console (`reporting.keep_libraries_off_the_console`), then
  `exit_on_user_error(fn, user_errors)`."""
  reporting.keep_libraries_off_the_console()
  return exit_on_user_error(fn, user_errors)


def exit_on_user_error(fn, user_errors=(errors.UsageError,)):
  """Runs fn(); a user error (bad flag, file, line, budget, a run that fails
  verification) and a fault of the system (an OSError: a save on a full
  disk, permission denied, a quota) print one `error:` line and exit with
  status 2 instead of a traceback; any other exception is a bug and keeps
  its traceback."""
  try:
    return fn()
  except user_errors as e:
    print(f"error: {error_message(e)}", file=sys.stderr)
    sys.exit(2)
  except RuntimeError as e:  # gin: a required binding was not provided
    if "Required bindings" not in str(e) and "gin" not in str(e).lower():
      raise
    print(f"error: gin: {' '.join(error_message(e).split())}", file=sys.stderr)
    sys.exit(2)
  except OSError as e:
    print(f"error: {' '.join(error_message(e).split())}", file=sys.stderr)
    sys.exit(2)
