"""What the five experiment commands share (semparse, seqpate, textcls,
dialog, experiments.retrieval).

An experiment is a grid of training runs and the tables made from them, and
it is resumable: a run whose `train_summary.json` says it trained every
planned step is not trained again (`ensure_trained`), an interrupted one
resumes from its checkpoint, and a table directory remembers the settings it
was made with and refuses to mix in rows made with others
(`check_settings`). Names and cells are written one way everywhere:
`eps_name` in run directories and tables, `mean_std` over seeds.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable, Sequence

import gin
import numpy as np

from dpjax import checkpoints, fileio, gin_cli, trainer

SUMMARY_FILENAME = "train_summary.json"
SETTINGS_FILENAME = "settings.json"


def eps_name(eps: float) -> str:
  """ε as run directories and tables name it: '3', '0.5', 'inf'."""
  return "inf" if math.isinf(eps) else f"{eps:g}"


def mean_std(values: Sequence[float | None], digits: int = 4) -> str:
  """'mean ± std' over seeds (sample std), the value alone for one seed,
  '–' for none; missing values (None) are left out."""
  values = [v for v in values if v is not None]
  if not values:
    return "–"
  if len(values) == 1:
    return f"{values[0]:.{digits}f}"
  return (f"{np.mean(values):.{digits}f} ± "
          f"{np.std(values, ddof=1):.{digits}f}")


def finished_summary(run_dir: str) -> dict | None:
  """The train summary of a run that trained every planned step, else None
  (no run, or one that stopped early: rerunning resumes it)."""
  path = os.path.join(run_dir, SUMMARY_FILENAME)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  return summary if summary.get("steps_done") == summary.get("steps") else None


def ensure_trained(run_dir: str, train: Callable[[], dict]) -> dict:
  """`finished_summary(run_dir)`, else `train()` (which trains or resumes
  the run in `run_dir` and returns its summary)."""
  return finished_summary(run_dir) or train()


def train_run(run_dir: str, gin_files: Sequence[str],
              bindings: Sequence[str]) -> dict:
  """The summary of the run in `run_dir` configured by `gin_files` and
  `bindings` (MODEL_DIR = run_dir), trained or resumed unless finished."""

  def train() -> dict:
    gin.clear_config()
    gin_cli.configure(list(gin_files), [f"MODEL_DIR = '{run_dir}'", *bindings])
    return trainer.train()

  return ensure_trained(run_dir, train)


def check_settings(root: str, settings: Any) -> None:
  """Saves `settings` (a dataclass or a JSON-able dict) with a new table
  directory; raises CheckpointMismatchError naming every field that differs
  if the table already there was made with other settings (its finished
  rows, their ε among them, would otherwise be reused as this table's)."""
  if dataclasses.is_dataclass(settings):
    settings = dataclasses.asdict(settings)
  current = json.loads(json.dumps(settings, default=str))
  path = os.path.join(root, SETTINGS_FILENAME)
  if not os.path.isfile(path):
    fileio.write_atomic(path, json.dumps(current, indent=2))
    return
  with open(path) as f:
    saved = json.load(f)
  checkpoints.check_compatible(
      saved, current, "Settings", source=f"the table in {root}",
      fix="Use another --output_dir, or the settings that table was made with.")
