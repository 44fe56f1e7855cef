"""The error dpjax raises on a user's bad setting or input.

The engine raises `UsageError` (a `ValueError`) with a message that names
the setting as the user wrote it (the gin macro or binding, the flag, the
file and line); the command lines (`dpjax.gin_cli.run_command`) print it as
one `error:` line and exit with status 2, and nothing else knows about the
command line. `is_int` and `is_number` are the type checks those settings
pass first (gin and flags give any Python value).
"""
import numpy as np


class UsageError(ValueError):
  """Bad command line or configuration; reported as one line, exit status 2."""


def is_int(value) -> bool:
  """An integer setting (bool is not one)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
  """A numeric setting (bool is not one)."""
  return isinstance(value, (int, float, np.integer, np.floating)) and \
      not isinstance(value, bool)
