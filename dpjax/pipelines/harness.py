"""What the five experiment commands share (semparse, seqpate, textcls,
dialog, experiments.retrieval).

An experiment is a grid of training runs and the tables made from them, and
it is resumable: a run whose `train_summary.json` says it trained every
planned step is not trained again (`ensure_trained`), an interrupted one
resumes from its checkpoint, and a table directory remembers the settings it
was made with and refuses to mix in rows made with others
(`check_settings`). Names and cells are written one way everywhere:
`eps_name` in run directories and tables, `mean_std` over seeds; rows go to
a results log (`read_results`, `append_result`), tables to Markdown + CSV
(`write_table`), and a metric against ε to one kind of figure
(`plot_vs_epsilon`). Every command has one shape (`run_command`,
`command_main`): t5x-style gin flags, then the experiment.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import gin
import numpy as np
from absl import logging as absl_logging

from dpjax import configurables, fileio, gin_cli, train
from dpjax.training import checkpoints
import tasks  # noqa: F401  (the data layer's gin configurables)

SUMMARY_FILENAME = "train_summary.json"
SETTINGS_FILENAME = "settings.json"
RESULTS_FILENAME = "results.jsonl"


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


def configured(make: Callable[[], Any], gin_files: Sequence[str],
               bindings: Sequence[str]) -> Any:
  """`make()` (a typed record such as `configurables.run_config()`, or a
  training run) as
  `gin_files` and `bindings` alone configure it: the gin config is cleared
  first, and stays bound afterwards."""
  gin.clear_config()
  gin_cli.configure(list(gin_files), list(bindings))
  return make()


def train_run(run_dir: str, gin_files: Sequence[str],
              bindings: Sequence[str] = (), **fields) -> dict:
  """The summary of the run in `run_dir`, trained or resumed unless
  finished: the `RunConfig` that `gin_files` and `bindings` (the user's
  files and flags, and the data layer's settings) configure, with `fields`
  set over it (`configurables.run_config(**fields)`; MODEL_DIR = run_dir)."""
  return ensure_trained(run_dir, lambda: configurables.train(configured(
      lambda: configurables.run_config(model_dir=run_dir, **fields),
      gin_files, bindings)))


def check_settings(root: str, settings: Any) -> None:
  """Saves `settings` (a dataclass or a JSON-able dict) with a new table
  directory; raises CheckpointMismatchError naming every field that differs
  if the table already there was made with other settings (its finished
  rows, their ε among them, would otherwise be reused as this table's).

  A dataclass field the saved settings lack (added to the settings after
  that table was made) reads as its default, the value the older code used,
  so adding a field with the old behaviour as its default keeps old tables
  resumable."""
  as_json = lambda x: json.loads(json.dumps(x, default=str))
  defaults = {}
  if dataclasses.is_dataclass(settings):
    defaults = as_json({f.name: f.default for f in dataclasses.fields(settings)
                        if f.default is not dataclasses.MISSING})
    settings = dataclasses.asdict(settings)
  current = as_json(settings)
  path = os.path.join(root, SETTINGS_FILENAME)
  if not os.path.isfile(path):
    fileio.write_atomic(path, json.dumps(current, indent=2))
    return
  with open(path) as f:
    saved = json.load(f)
  saved = {**{k: v for k, v in defaults.items() if k in current}, **saved}
  checkpoints.check_compatible(
      saved, current, "Settings", source=f"the table in {root}",
      fix="Use another --output_dir, or the settings that table was made with.")


# ---------------------------------------------------------------------------
# Results log, tables, figures.
# ---------------------------------------------------------------------------


def read_results(path: str) -> list[dict]:
  """The rows of a results log (JSON Lines) in order; [] before the first."""
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_results(path: str, rows: Sequence[dict]) -> None:
  """The results log as exactly `rows`, atomically (a crash leaves the old
  log whole)."""
  fileio.write_atomic(path, "".join(json.dumps(r, default=str) + "\n"
                                    for r in rows))


def append_result(path: str, row: dict, key: str = "key") -> None:
  """Adds `row` to the log, in place of a row with the same `row[key]`, so
  a resumed experiment that redoes a row does not list it twice."""
  rows = [r for r in read_results(path) if r.get(key) != row[key]]
  write_results(path, [*rows, row])


def write_table(rows: Sequence[Sequence[str]], columns: Sequence[str],
                md_path: str, csv_path: str | None = None, *, title: str,
                notes: Sequence[str] = ()) -> str:
  """Writes a table of string cells as Markdown ('# title', the table, then
  each note as a paragraph) and, given `csv_path`, as CSV, each atomically;
  returns the Markdown."""
  lines = [f"# {title}", "", *fileio.markdown_table(columns, rows)]
  for note in notes:
    lines += ["", note]
  text = "\n".join(lines) + "\n"
  fileio.write_atomic(md_path, text)
  if csv_path:
    fileio.write_csv(csv_path, columns, rows)
  return text


def pyplot():
  """matplotlib's pyplot on the Agg backend (no display needed); imported
  here, lazily: only the commands that draw need matplotlib."""
  import matplotlib  # lazy: only for figures
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  return plt


def save_figure(fig, path: str) -> None:
  """`fig` as a PNG at `path`, atomically, and closed."""
  with fileio.open_atomic(path, "wb") as f:
    fig.savefig(f, format="png", dpi=120)
  pyplot().close(fig)


def epsilon_positions(epsilons) -> dict[float, int]:
  """Where each ε goes on the x-axis: the finite ones in increasing order,
  evenly spaced, and ε = ∞ (no privacy) last, at the right."""
  finite = sorted({float(e) for e in epsilons if not math.isinf(e)})
  positions = {e: i for i, e in enumerate(finite)}
  if any(math.isinf(e) for e in epsilons):
    positions[math.inf] = len(finite)
  return positions


def plot_vs_epsilon(series: Mapping[str, Mapping[float, float | None]],
                    path: str, ylabel: str, *, title: str | None = None,
                    references: Mapping[str, float] = {}) -> dict[float, int]:
  """Draws each series ({ε: value}; None and NaN values left out) against
  ε, ∞ at the right as the non-private point, and each reference as a
  horizontal line; saves a PNG at `path`; returns the x position of each
  ε (`epsilon_positions`)."""
  plt = pyplot()
  position = epsilon_positions([e for s in series.values() for e in s])
  fig, ax = plt.subplots(figsize=(5, 3.5))
  styles = ("o-", "s--", "^-.", "d:", "v-")
  for (label, values), style in zip(series.items(),
                                    styles * len(series)):
    points = sorted((position[float(e)], v) for e, v in values.items()
                    if v is not None and not math.isnan(v))
    if points:
      ax.plot(*zip(*points), style, label=label)
  for label, y in references.items():
    ax.axhline(y, color="gray", ls=":", label=label)
  order = sorted(position, key=position.get)
  ax.set_xticks([position[e] for e in order],
                ["∞" if math.isinf(e) else eps_name(e) for e in order])
  ax.set_xlabel("ε")
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  save_figure(fig, path)
  return position


# ---------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------


def parse_epsilons(text: str) -> list[float]:
  """The ε-list flags: '3,8,inf' -> [3.0, 8.0, inf]."""
  return [float(x) for x in text.split(",")]


def run_command(argv: Sequence[str] | None, description: str,
                add_arguments: Callable, run: Callable, *,
                extra_prefixes: tuple[str, ...] = ()):
  """What every experiment command does: quiet absl, t5x-style gin flags
  (`gin_cli.parse_args`; `extra_prefixes` for runs configured apart), the
  data layer's gin configurables registered, then
  `run(args, gin_files, bindings)`."""
  absl_logging.set_verbosity(absl_logging.ERROR)
  args, files, bindings = gin_cli.parse_args(
      list(sys.argv[1:] if argv is None else argv), description,
      add_arguments, extra_prefixes)
  return run(args, files, bindings)


def command_main(main: Callable[[], Any]) -> None:
  """`main()` as a command: a user error is one line and exit status 2."""
  gin_cli.run_command(main, train.user_errors())
