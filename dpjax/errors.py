"""The error dpjax raises on a user's bad setting or input.

The engine raises `UsageError` (a `ValueError`) with a message that names
the setting as the user wrote it (the gin macro or binding, the flag, the
file and line); the command lines (`dpjax.gin_cli.run_command`) print it as
one `error:` line and exit with status 2, and nothing else knows about the
command line.
"""


class UsageError(ValueError):
  """Bad command line or configuration; reported as one line, exit status 2."""
