"""The experiment harness the five pipelines share (`dpjax.harness`)."""
import dataclasses
import json
import math
import statistics

import pytest

from dpjax import checkpoints, harness


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
