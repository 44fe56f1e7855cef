"""Malformed lines of the published data files: one error type, one policy.

Every reader in `dpjax.data.readers` streams its file through `decoded_lines`
and hands each problem to a `MalformedPolicy`: "fail" raises
`MalformedLineError` ("path:line: reason"); "skip" drops the line (or the
record it starts), counts it and logs one warning with the count and the
first location.
"""
from __future__ import annotations

import json
import logging
from typing import Iterator

ON_MALFORMED = ("fail", "skip")

logger = logging.getLogger(__name__)


class MalformedLineError(ValueError):
  """A line of a data file cannot be used; message is `path:lineno: why`."""

  def __init__(self, path: str, lineno: int, reason: str):
    self.path, self.lineno, self.reason = path, lineno, reason
    super().__init__(f"{path}:{lineno}: {reason}")


class MalformedPolicy:
  """Raises on a malformed line ("fail") or counts and skips it ("skip")."""

  def __init__(self, on_malformed: str, what: str):
    if on_malformed not in ON_MALFORMED:
      raise ValueError(
          f"on_malformed must be one of {ON_MALFORMED}, got {on_malformed!r}"
      )
    self.on_malformed = on_malformed
    self.what = what
    self.count = 0
    self.first: str | None = None

  def __call__(self, path: str, lineno: int, reason: str) -> None:
    error = MalformedLineError(path, lineno, reason)
    if self.on_malformed == "fail":
      raise error
    self.count += 1
    if self.first is None:
      self.first = str(error)

  def report(self) -> None:
    """Logs one warning with the skipped count and first location, if any."""
    if self.count:
      logger.warning(
          "Skipped %d malformed %s (first: %s)", self.count, self.what,
          self.first,
      )


def json_object(line: str) -> dict:
  """One JSON Lines record, which must be an object; ValueError says what is
  wrong (for a reader's `MalformedLineError`)."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"not valid JSON ({e.msg} at character {e.pos + 1})") from e
  if not isinstance(record, dict):
    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
  return record


def decoded_lines(path: str, policy: MalformedPolicy
                  ) -> Iterator[tuple[int, str]]:
  """(line number, text without the line break) of each non-blank line; a
  line that is not UTF-8 goes to `policy`."""
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError as e:
        policy(path, lineno, f"invalid UTF-8 ({e.reason})")
        continue
      if line.strip():
        yield lineno, line
