"""TensorBoard summaries and the console line, read back independently."""
from __future__ import annotations

import io
import math

import glob

import tensorflow as tf

from dpjax.training import reporting


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
  """name -> [(step, value)] read with TensorFlow's own event reader."""
  out = {}
  for path in sorted(glob.glob(f"{log_dir}/events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_summaries_write_finite_scalars_and_skip_infinite(tmp_path):
  s = reporting.Summaries(str(tmp_path))
  s.scalars("train", 3, {"loss": 1.5, "epsilon": math.inf})
  s.scalars("train", 4, {"loss": 1.25, "epsilon": 2.0})
  s.close()
  scalars = _scalars(tmp_path / "train")
  assert scalars["loss"] == [(3, 1.5), (4, 1.25)]
  assert scalars["epsilon"] == [(4, 2.0)]


def test_progress_line_shows_infinite_target():
  out = io.StringIO()
  line = reporting.Progress(10, 0, stream=out).report(
      5, loss=0.5, eps_spent=math.inf, eps_target=math.inf,
      tokens_per_s=1234.0, clipped=0.25)
  assert "step 5/10" in line and "ε inf/∞" in line and "clipped 25.0%" in line
  assert out.getvalue().strip() == line


def test_progress_line_of_a_mixed_run_counts_both_kinds_of_step():
  line = reporting.Progress(10, 0, stream=io.StringIO()).report(
      4, loss=0.5, eps_spent=1.0, eps_target=8.0, tokens_per_s=10.0,
      clipped=0.0, mixed=(1, 3, 0.25))
  assert line.endswith("| DP 1 / public 3 steps, public loss 0.2500")


def test_progress_line_of_public_steps_only_has_no_dp_fields():
  """A window without a DP step (pretraining, a public stretch of a
  redaction schedule) has no DP loss or clipped fraction to show."""
  line = reporting.Progress(10, 0, stream=io.StringIO()).report(
      4, loss=math.nan, eps_spent=0.0, eps_target=math.inf,
      tokens_per_s=10.0, clipped=math.nan, mixed=(0, 4, 3.25))
  assert "nan" not in line and "loss" not in line.split("| DP")[0]
  assert line.endswith("| DP 0 / public 4 steps, public loss 3.2500")
