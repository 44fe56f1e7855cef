"""The experiment harness the five pipelines share (`dpjax.pipelines.harness`)."""
import csv
import dataclasses
import json
import math
import statistics

import pytest

from dpjax.training import checkpoints
from dpjax import errors, gin_cli
from dpjax.pipelines import harness


def test_eps_names():
  assert [harness.eps_name(e) for e in (3.0, 0.5, 16, math.inf)] == [
      "3", "0.5", "16", "inf"]


def test_mean_std_is_the_sample_mean_and_std_over_seeds():
  values = [0.1, 0.25, 0.4]
  mean, std = statistics.mean(values), statistics.stdev(values)
  assert harness.mean_std(values) == f"{mean:.4f} ± {std:.4f}"
  assert harness.mean_std(values, digits=3) == f"{mean:.3f} ± {std:.3f}"
  assert harness.mean_std([0.5, None]) == "0.5000"
  assert harness.mean_std([None]) == "–"


def _summary(run_dir, steps_done, steps=10):
  run_dir.mkdir(exist_ok=True)
  (run_dir / harness.SUMMARY_FILENAME).write_text(json.dumps(
      {"steps": steps, "steps_done": steps_done, "epsilon_spent": 1.0}))


def test_only_an_unfinished_run_is_trained(tmp_path):
  calls = []
  train = lambda: calls.append(1) or {"trained": True}
  assert harness.ensure_trained(str(tmp_path / "none"), train) == {"trained": True}
  _summary(tmp_path / "stopped", steps_done=4)  # preempted: resume it
  assert harness.ensure_trained(str(tmp_path / "stopped"), train) == {"trained": True}
  _summary(tmp_path / "done", steps_done=10)
  assert harness.ensure_trained(str(tmp_path / "done"), train)["steps_done"] == 10
  assert len(calls) == 2


@dataclasses.dataclass(frozen=True)
class _Settings:
  epsilon: float = 3.0
  teachers: int = 64


def test_a_table_refuses_rows_made_with_other_settings(tmp_path):
  harness.check_settings(str(tmp_path), _Settings())
  harness.check_settings(str(tmp_path), _Settings())  # the same: fine
  with pytest.raises(checkpoints.CheckpointMismatchError,
                     match="epsilon: checkpoint has 3.0, this run has 8.0"):
    harness.check_settings(str(tmp_path), _Settings(epsilon=8.0))
  assert json.loads((tmp_path / harness.SETTINGS_FILENAME).read_text()) == {
      "epsilon": 3.0, "teachers": 64}


def test_a_field_newer_than_the_table_resumes_only_at_its_default(tmp_path):
  # A table saved before `teachers` existed: the older code used 64.
  (tmp_path / harness.SETTINGS_FILENAME).write_text('{"epsilon": 3.0}')
  harness.check_settings(str(tmp_path), _Settings())
  with pytest.raises(checkpoints.CheckpointMismatchError,
                     match="teachers: checkpoint has 64, this run has 8"):
    harness.check_settings(str(tmp_path), _Settings(teachers=8))


def test_a_table_is_written_as_markdown_and_csv(tmp_path):
  rows = [["3", "0.5000 ± 0.0100"], ["inf", "a|b, c"]]
  md, csv_path = tmp_path / "t.md", tmp_path / "t.csv"
  text = harness.write_table(rows, ["ε", "acc"], str(md), str(csv_path),
                             title="T", notes=["note one", "note two"])
  assert md.read_text() == text == (
      "# T\n\n| ε | acc |\n|---|---|\n| 3 | 0.5000 ± 0.0100 |\n"
      "| inf | a|b, c |\n\nnote one\n\nnote two\n")
  with open(csv_path, newline="") as f:
    assert list(csv.reader(f)) == [["ε", "acc"], *rows]


def test_the_results_log_resumes_and_replaces_a_redone_row(tmp_path):
  path = str(tmp_path / harness.RESULTS_FILENAME)
  assert harness.read_results(path) == []
  harness.append_result(path, {"key": "a", "v": 1.0})
  harness.append_result(path, {"key": "b", "v": math.inf})
  harness.append_result(path, {"key": "a", "v": 2.0})  # redone after a crash
  assert harness.read_results(path) == [{"key": "b", "v": math.inf},
                                        {"key": "a", "v": 2.0}]
  harness.write_results(path, [{"key": "c"}])
  assert harness.read_results(path) == [{"key": "c"}]


def test_the_plot_puts_eps_inf_at_the_right(tmp_path):
  path = tmp_path / "p.png"
  positions = harness.plot_vs_epsilon(
      {"a": {math.inf: 0.9, 8.0: 0.5, 3.0: 0.2},
       "b": {16.0: float("nan"), 3.0: None}},
      str(path), "metric", references={"no DP": 1.0})
  assert positions == {3.0: 0, 8.0: 1, 16.0: 2, math.inf: 3}
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert harness.epsilon_positions([8.0, 3.0]) == {3.0: 0, 8.0: 1}


def test_prefixed_gin_flags_configure_runs_apart():
  args, files, bindings = gin_cli.parse_args(
      ["--gin.EPOCHS=2", "--parser_gin.EPOCHS=3",
       "--parser_gin_bindings=BATCH_SIZE = 4", "--parser_gin_file=p.gin",
       "--gin_file=a.gin"], "test", extra_prefixes=("parser_gin",))
  assert (files, bindings) == (["a.gin"], ["EPOCHS = 2"])
  assert args.parser_gin_file == ["p.gin"]
  assert args.parser_gin_bindings == ["BATCH_SIZE = 4", "EPOCHS = 3"]
  args, _, _ = gin_cli.parse_args([], "test", extra_prefixes=("parser_gin",))
  assert (args.parser_gin_file, args.parser_gin_bindings) == (None, [])
  with pytest.raises(errors.UsageError, match="--parser_gin.NAME=VALUE"):
    gin_cli.parse_args(["--parser_gin.EPOCHS"], "test",
                       extra_prefixes=("parser_gin",))


def test_seqpate_gin_flags_reach_the_noisysgd_settings(tmp_path, monkeypatch):
  from dpjax.pipelines.seqpate import __main__ as cli, experiment
  seen = {}

  def table1(output_dir, *, settings, **kwargs):
    seen["settings"] = settings
    md = tmp_path / "table1.md"
    md.write_text("table\n")
    return {"table_md": str(md)}

  monkeypatch.setattr(experiment, "table1", table1)
  cli.main(["table1", f"--output_dir={tmp_path}", "--gin.EPOCHS=10",
            "--gin_bindings=BATCH_SIZE = 4"])
  settings = seen["settings"]
  assert settings.noisysgd_bindings == ("BATCH_SIZE = 4", "EPOCHS = 10")
  assert settings.noisysgd_gin_files == ("seqpate_noisysgd.gin",)
  # Saved as plain binding strings: tables made with --noisysgd_binding
  # resume.
  harness.check_settings(str(tmp_path), settings)
  saved = json.loads((tmp_path / harness.SETTINGS_FILENAME).read_text())
  assert saved["noisysgd_bindings"] == ["BATCH_SIZE = 4", "EPOCHS = 10"]
