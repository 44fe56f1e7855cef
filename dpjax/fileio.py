"""Atomic file writes: a reader sees the old file or the new one, never half."""
from __future__ import annotations

import os
import tempfile


def write_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to a temp file beside `path`, fsyncs it, renames it over
  `path`, and fsyncs the directory so the rename itself survives a crash."""
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(
      dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise
  dir_fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(dir_fd)
  finally:
    os.close(dir_fd)
