"""What a run tells its user: a console progress line and TensorBoard summaries.

In a multi-host run only process 0 speaks: the others' reports are no-ops, so
logs and event files are written once.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time

import jax

LIBRARY_LOG_FILENAME = "library.log"


def say(message: str) -> None:
  """One console line from the run (process 0 only)."""
  if jax.process_index() == 0:
    print(f"dpjax: {message}", flush=True)


class _LibraryLog(logging.Handler):
  """Where libraries' log records and teardown tracebacks go instead of the
  console: a file once `log_libraries_to` names one, else nowhere. A write
  that fails (the disk that failed a save) is dropped, never reported."""

  def __init__(self):
    super().__init__()
    self.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    self.path: str | None = None

  def emit(self, record: logging.LogRecord) -> None:
    self.write(self.format(record))

  def write(self, text: str) -> None:
    if self.path is None:
      return
    try:
      with open(self.path, "a") as f:
        f.write(text.rstrip("\n") + "\n")
    except (OSError, ValueError):
      pass


_LIBRARY_LOG = _LibraryLog()


def keep_libraries_off_the_console() -> None:
  """For a command's process: Python logging records (absl, orbax,
  TensorFlow's Python side) and exceptions Python cannot raise anywhere
  (orbax's asyncio callbacks on a closed event loop after a failed save) go
  to the library log, so that dpjax's own lines, and its one `error:` line,
  are what the console shows."""
  logging.root.handlers = [_LIBRARY_LOG]
  logging.lastResort = _LIBRARY_LOG

  def unraisable(u) -> None:
    import traceback
    _LIBRARY_LOG.write(
        f"unraisable exception in {u.object!r}: " + "".join(
            traceback.format_exception(u.exc_type, u.exc_value,
                                       u.exc_traceback)))

  sys.unraisablehook = unraisable


def log_libraries_to(model_dir: str) -> None:
  """Appends the library log to MODEL_DIR/library.log from now on (process
  0; whatever `keep_libraries_off_the_console` keeps off the console)."""
  if jax.process_index() == 0:
    _LIBRARY_LOG.path = os.path.join(model_dir, LIBRARY_LOG_FILENAME)


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
  """One console line per report: step, loss, ε spent / target, tokens/s, ETA."""

  def __init__(self, total_steps: int, start_step: int, stream=sys.stdout):
    self.total = total_steps
    self.start_step = start_step
    self.start_time = time.perf_counter()
    self.stream = stream

  def report(self, step: int, *, loss: float, eps_spent: float,
             eps_target: float, tokens_per_s: float, clipped: float,
             mixed: tuple[int, int, float] | None = None) -> str:
    """`mixed`: (DP steps, public steps, public loss) of a run that mixes
    non-private steps in (a redaction schedule); `loss` is the DP steps'."""
    elapsed = time.perf_counter() - self.start_time
    done = max(step - self.start_step, 1)
    eta = elapsed / done * (self.total - step)
    width = 20
    filled = int(width * step / max(self.total, 1))
    bar = "#" * filled + "." * (width - filled)
    target = "∞" if math.isinf(eps_target) else f"{eps_target:.2f}"
    no_dp = bool(mixed) and math.isnan(loss)  # a window of public steps only
    line = (f"[{bar}] step {step}/{self.total} | "
            + ("" if no_dp else f"loss {loss:.4f} | ")
            + f"ε {eps_spent:.3f}/{target} | {tokens_per_s:,.0f} tok/s | "
            + ("" if no_dp else f"clipped {100 * clipped:.1f}% | ")
            + f"ETA {_duration(eta)}")
    if mixed:
      line += (f" | DP {mixed[0]} / public {mixed[1]} steps, public loss "
               f"{mixed[2]:.4f}")
    if jax.process_index() == 0:
      print(line, file=self.stream, flush=True)
    return line


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch.

  tensorboardX imports torch when it is installed, only so that it can take
  torch tensors; dpjax writes floats. Unless torch is loaded already, it is
  hidden for that import, which then takes 0.15 s instead of 1.67 s
  (docs/benchmarks.md). Imported here, not at the top: only a run pays.
  """
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    if hide and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


class Summaries:
  """TensorBoard event files under MODEL_DIR/{train,eval} (no TensorFlow)."""

  def __init__(self, model_dir: str):
    SummaryWriter = _summary_writer_class()  # pylint: disable=invalid-name
    self._writers = {
        split: SummaryWriter(os.path.join(model_dir, split))
        for split in ("train", "eval")} if jax.process_index() == 0 else {}

  def scalars(self, split: str, step: int, values: dict[str, float]) -> None:
    """Writes `values` at `step` to the `split` ('train' or 'eval') event file.

    Only process 0 writes; non-finite values are skipped.
    """
    if not self._writers:  # not process 0
      return
    writer = self._writers[split]
    for name, value in values.items():
      if math.isfinite(value):  # ε = inf (non-private) has no point to plot
        writer.add_scalar(name, value, step)
    writer.flush()

  def close(self) -> None:
    """Closes the event files."""
    for writer in self._writers.values():
      writer.close()
