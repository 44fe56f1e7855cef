"""`python -m dpjax.bench --suite`: the rows the issue names, the ladders and
the budget, and the targets recomputed by hand from the rows."""
import json
import os
import subprocess
import sys

import pytest

from dpjax.bench import suite

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(row):
  return dict(a[2:].split("=", 1) if "=" in a else (a[2:], True)
              for a in row.argv)


def test_the_gpu_suite_holds_the_comparison_set():
  rows = [_args(r) for r in suite.rows(suite.SUITES["gpu"]) if not r.ladder]
  assert all(r["dtype"] == "bfloat16" for r in rows)
  gpt2_32 = {r["mode"] for r in rows if r["model"] == "gpt2_small"
             and r["batch"] == "32" and r["seq"] == "256"}
  assert gpt2_32 == {"nodp", "vmap", "ghost", "jax_privacy"}
  assert {r["mode"] for r in rows if r["model"] == "gpt2_small"
          and r["batch"] == "64"} == {"nodp", "ghost"}
  assert {(r["mode"], r["input_length"], r["target_length"]) for r in rows
          if r["model"] == "t5_base"} == {("nodp", "384", "128"),
                                          ("ghost", "384", "128")}
  [xl] = [r for r in rows if r["model"] == "t5_xl"]
  assert (xl["batch"], xl["seq"], xl["mode"], xl["remat"]) == (
      "32", "512", "ghost", "layer") and xl["memory_only"]
  # Compile-only, so last: the rows before it need the device.
  assert _args(suite.rows(suite.SUITES["gpu"])[-1]) == xl


def fake_results(step_time, oom_from=None, unavailable=()):
  """A runner: step time by mode, OOM at batches >= `oom_from`."""
  calls = []

  def run(argv, timeout_s):
    args = dict(a[2:].split("=", 1) for a in argv if "=" in a)
    calls.append(args)
    batch, mode = int(args["batch"]), args["mode"]
    if mode in unavailable:
      return {"error": f"{mode} mode needs it installed"}
    if oom_from and batch >= oom_from:
      return {"error": "out of device memory: RESOURCE_EXHAUSTED"}
    if "--memory_only" in argv:
      return {"memory_analysis": {"peak_estimate_bytes": 2**30}}
    t = step_time[mode] * batch / 32
    return {"step_time_s": t, "tokens_per_s": batch * 256 / t,
            "mfu": 0.4 if mode == "nodp" else 0.3, "flops": 1.0,
            "device_kind": "fake", "num_devices": 1, "jax_version": "x"}

  return run, calls


SPEC = suite.SUITES["gpu"]
TIMES = {"nodp": 1.0, "vmap": 3.0, "ghost": 1.08, "jax_privacy": 4.0}


def test_a_ladder_stops_at_its_first_out_of_memory_rung():
  run, calls = fake_results(TIMES, oom_from=256)
  results = suite.run_suite(SPEC, budget_s=60, run=run)
  ghost_ladder = [r for r in results if r["ladder"] == "ghost"]
  assert ["error" in r for r in ghost_ladder] == [False, True, False]
  assert ghost_ladder[2]["skipped"] == "a smaller batch did not fit"
  # The 512 rung was never run; the jax_privacy ladder ran to its 256 OOM.
  assert {int(c["batch"]) for c in calls if c["mode"] == "ghost"} == {
      32, 64, 128, 256}
  assert sorted(int(c["batch"]) for c in calls
                if c["mode"] == "jax_privacy") == [32, 64, 128, 256]


def test_rows_past_the_budget_are_skipped(monkeypatch):
  clock = iter(range(0, 10**6, 100))  # every row takes 100 s
  monkeypatch.setattr(suite.time, "monotonic", lambda: next(clock))
  run, calls = fake_results(TIMES)
  results = suite.run_suite(SPEC, budget_s=250, run=run)
  assert len(calls) == 2
  assert all(r["skipped"] == "time budget spent" for r in results[2:])


def test_targets_recomputed_from_the_rows():
  run, _ = fake_results(TIMES, oom_from=512)
  results = suite.run_suite(SPEC, budget_s=60, run=run)
  (_, step, step_met), (_, tput, tput_met), (_, mfu, mfu_met) = (
      suite.targets(SPEC, results))
  # Ghost is 1.08x nodp at every batch where both ran.
  assert step == pytest.approx(1.08) and step_met
  # Fake tokens/s do not depend on the batch: 4.0 / 1.08 for every rung.
  assert tput == pytest.approx(4.0 / 1.08) and tput_met
  assert mfu == 0.4 and mfu_met
  slow, _ = fake_results({**TIMES, "ghost": 1.2})
  assert not suite.targets(SPEC, suite.run_suite(SPEC, budget_s=60,
                                                 run=slow))[0][2]


def test_missing_rows_make_a_target_not_applicable():
  run, _ = fake_results(TIMES, unavailable=("jax_privacy",))
  results = suite.run_suite(SPEC, budget_s=60, run=run)
  assert suite.targets(SPEC, results)[1][1:] == (None, None)
  table = suite.table(SPEC, results, "cmd")
  assert "| n/a |" in table and "jax_privacy mode needs it" in table


def test_the_table_has_a_line_per_row_and_the_step_ratio():
  run, _ = fake_results(TIMES)
  results = suite.run_suite(SPEC, budget_s=60, run=run)
  lines = suite.table(SPEC, results, "cmd").splitlines()
  body = [l for l in lines if l.startswith("| gpt2") or l.startswith("| t5")]
  assert len(body) == len(suite.rows(SPEC))
  ghost_32 = next(l for l in body if "| 32 x (256) | ghost |" in l)
  assert "| 1.080 |" in ghost_32


def test_a_real_row_and_the_cli(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  row = suite.rows(suite.SUITES["smoke"])[0]
  result = suite.run_row(row.argv, 300, autotune_dir=str(tmp_path))
  assert result["mode"] == "nodp" and result["step_time_s"] > 0
  # Its process was told where to write the GPU autotuner's results.
  dump = suite.autotune_file(str(tmp_path), row.argv)
  assert f"--xla_gpu_dump_autotune_results_to={dump}" in result["xla_flags"]
  assert os.path.dirname(dump) == str(tmp_path)
  # The CLI dispatches --suite; a one-second budget stops the first row.
  out = tmp_path / "rows.jsonl"
  proc = subprocess.run(
      [sys.executable, "-m", "dpjax.bench", "--suite=smoke", "--budget_s=1",
       "--no_cost", f"--json_out={out}"], cwd=REPO, env=env,
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(rows) == len(suite.rows(suite.SUITES["smoke"]))
  assert all("--no_cost" in r["argv"] for r in rows)
  assert "stopped at the budget" in rows[0]["error"]
  assert all(r.get("skipped") == "time budget spent" for r in rows[1:])
  assert "| target | measured | met |" in proc.stdout
