"""Atomic file writes: a reader sees the old file or the new one, never half;
and the result tables every experiment writes (markdown lines, CSV)."""
from __future__ import annotations

import contextlib
import csv
import os
import tempfile
from typing import IO, Iterable, Iterator, Sequence


@contextlib.contextmanager
def open_atomic(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
  """A file opened for writing ("w" or "wb") beside `path`; on a clean exit
  it is fsynced, renamed over `path`, and the directory fsynced so the
  rename itself survives a crash. On an exception `path` is untouched."""
  if mode not in ("w", "wb"):
    raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(
      dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})
                   ) as f:
      yield f
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


def write_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` atomically (see `open_atomic`)."""
  with open_atomic(path) as f:
    f.write(text)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
  """The lines of a markdown table of string cells."""
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
          *("| " + " | ".join(r) + " |" for r in rows)]


def write_csv(path: str | os.PathLike, header: Sequence[str],
              rows: Iterable[Sequence[str]]) -> None:
  """`header`, then `rows`, as a CSV file (csv's default dialect), atomically."""
  with open_atomic(path) as f:
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
