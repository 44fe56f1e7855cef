"""`python -m dpjax.train ... --dry_run` and automatic sizing on a tiny T5:
the JSON line's fields against dp-accounting and the model's own sizes,
that nothing is written, that a low device memory gives a smaller
microbatch, and that the run it picks trains as the hand-chosen one does."""
from __future__ import annotations

import dataclasses
import glob
import json
import os

import dp_accounting
from dp_accounting import pld
import gin
import jax
import numpy as np
import pytest

from dpjax.training import checkpoints, dry_run, partitioning, sizing, step_cost
from dpjax import configurables
from dpjax import gin_cli, train
from dpjax.models import trainable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--gin_file=quickstart.gin", "--gin.TRAIN_STEPS=4",
        "--gin.BATCH_SIZE=32",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        "--gin.train.eval_period=0", "--gin.train.log_period=1",
        "--gin.train.generate_after_training=False",
        "--gin.train.pinned_secret_seed=7"]
FIELDS = {"n", "q", "steps", "dp_steps", "start_step", "sigma", "epsilon",
          "target_epsilon", "delta", "accountant", "sampling", "privacy_unit",
          "mechanism",
          "clipping_method", "ghost_summation", "remat", "microbatch_size", "accumulation_calls",
          "auto_sizing", "mesh", "rules", "compute_dtype", "params",
          "peak_bytes_per_device", "state_bytes_per_device",
          "device_memory_bytes", "device_memory_source", "fits",
          "flops_per_step", "bytes_accessed_per_step",
          "cost_scaled_from_microbatch", "cost_per_layer_from", "backend",
          "device_kind", "devices", "scan_layers"}


# A TPU compiler's refusal for a fusion's on-chip memory, which names no
# figure (T5-XL's on v4-32 at 160 a call).
VMEM_REFUSAL = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out "
                "of memory in memory space vmem. Used 16.36M of 16.00M vmem.\n"
                "  1. Size: 1.0K ...")


def _dry_run_and_console(capsys, model_dir, *flags) -> tuple[dict, str]:
  """A dry run's JSON line and all it printed."""
  try:
    train.main([*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--dry_run",
                *flags])
  finally:
    gin.clear_config()
  out = capsys.readouterr().out
  return json.loads(out.strip().splitlines()[-1]), out


def _dry_run(capsys, model_dir, *flags) -> dict:
  return _dry_run_and_console(capsys, model_dir, *flags)[0]


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
  """Two dry runs with automatic sizing, into MODEL_DIRs that must stay
  absent: 'ample', with the memory of the whole padded batch, then 'low',
  with ~60% of its peak, which also times 2 steps (its search starts from
  the whole batch, compiled by then)."""
  root = tmp_path_factory.mktemp("dry")
  records = {}
  with pytest.MonkeyPatch.context() as mp:
    capture = _Capture(mp)
    for name, memory, timed in (("ample", "64GiB", []),
                                ("low", None, ["--dry_run_steps=2"])):
      if memory is None:  # 60% of the whole-batch peak, over the headroom
        memory = int(0.6 * records["ample"]["peak_bytes_per_device"] / 0.9)
      train.main([*TINY, f"--gin.MODEL_DIR='{root / name}'", "--dry_run",
                  "--gin.MICROBATCH_SIZE='auto'",
                  f"--gin.train.device_memory={memory}", *timed])
      gin.clear_config()
      records[name] = json.loads(capture.lines[-1])
  return root, records


class _Capture:
  """print() lines, captured without capsys (module-scoped fixtures)."""

  def __init__(self, mp):
    self.lines = []
    mp.setattr("builtins.print", lambda *a, **k: self.lines.append(
        " ".join(str(x) for x in a)))


def test_dry_run_writes_nothing(dry_runs):
  """Neither run, the timed one included, leaves its MODEL_DIR (secret,
  sizing record, checkpoints)."""
  root, _ = dry_runs
  assert os.listdir(root) == []


def test_dry_run_prints_every_field(dry_runs):
  _, records = dry_runs
  for r in records.values():
    assert FIELDS <= set(r)
  assert {"timed_steps", "step_time_s", "projected_wall_s"} <= set(
      records["low"])


def test_dry_run_plan_is_dp_accountings_pld(dry_runs):
  """n, q and steps of the sample; σ spends the target ε by dp-accounting's
  own PLD accountant, called here directly."""
  r = dry_runs[1]["low"]
  assert (r["n"], r["steps"], r["dp_steps"]) == (2998, 4, 4)
  assert r["q"] == pytest.approx(32 / 2998)
  assert r["accountant"] == "pld" and r["sampling"] == "poisson"
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          r["q"], dp_accounting.GaussianDpEvent(r["sigma"])), 4)
  ).get_epsilon(r["delta"])
  assert r["epsilon"] == pytest.approx(direct, rel=1e-9)
  assert 0.99 * 3.0 <= direct <= 3.0
  assert r["delta"] == pytest.approx(1 / (2 * 2998))


def test_dry_run_sizes_match_the_model(dry_runs):
  """Adam's state is params + two moments in float32 (plus counters); the
  compiled peak holds at least that; the step's FLOPs are at least a
  forward and backward pass (6 x params per token) over one token of each
  padded example (in one call, and in the low run's k > 1)."""
  gin_cli.configure(["quickstart.gin"], [])
  try:
    config = configurables.run_config().model_config
  finally:
    gin.clear_config()
  params = sum(x.size for x in jax.tree.leaves(trainable.trainable(
      config, {"inputs": 32, "targets": 8}).abstract_params()[0]))
  for r in dry_runs[1].values():
    assert r["params"] == params
    assert 0 <= r["state_bytes_per_device"] - 12 * params <= 64
    assert r["peak_bytes_per_device"] > r["state_bytes_per_device"]
    examples = r["microbatch_size"] * r["accumulation_calls"]
    assert examples >= 32
    assert r["flops_per_step"] >= 6 * params * examples
    assert r["fits"] and r["backend"] == "cpu" and r["mesh"] == {"data": 1}


def test_dry_run_projects_the_wall_time_from_timed_steps(dry_runs):
  r = dry_runs[1]["low"]
  assert r["timed_steps"] == 2 and r["step_time_s"] > 0
  assert r["projected_wall_s"] == pytest.approx(4 * r["step_time_s"])


def test_ample_memory_takes_the_whole_batch_in_one_call(dry_runs):
  r = dry_runs[1]["ample"]
  assert r["auto_sizing"] and r["accumulation_calls"] == 1
  assert r["fits"]


def test_low_memory_takes_a_smaller_microbatch_that_fits(dry_runs):
  ample, low = dry_runs[1]["ample"], dry_runs[1]["low"]
  assert low["microbatch_size"] < ample["microbatch_size"]
  assert low["accumulation_calls"] > 1 and low["fits"]
  assert low["peak_bytes_per_device"] <= low["device_memory_bytes"]
  assert low["peak_bytes_per_device"] < ample["peak_bytes_per_device"]


@pytest.mark.parametrize("m, devices", [(160, 32), (1088, 64), (96, 32),
                                        (8, 1), (32, 32)])
def test_refused_cost_programs_halve_to_multiples_of_the_devices(m, devices):
  """After m, each microbatch the cost programs are tried at is the largest
  multiple of the data-parallel devices at most half the one before (160
  on v4-32's 32 devices: 64, then 32; 80 would not split), down to one per
  device."""
  sizes = step_cost.cost_microbatches(m, devices)
  assert sizes[0] == m and sizes[-1] >= devices
  for before, after in zip(sizes, sizes[1:]):
    assert after % devices == 0
    assert after <= before / 2 < after + devices
  assert sizes[-1] // 2 < devices


def test_sizing_skips_candidates_the_compiler_refuses_without_a_figure(
    dry_runs, capsys, tmp_path, monkeypatch):
  """A candidate the target's compiler refuses for a fusion's on-chip
  memory (a TPU's vmem; no figure named) does not fit: with memory for the
  whole batch, a refusal above half of it plans the largest candidate
  below, and the console says what the compiler said."""
  real = step_cost.step_cost
  whole = dry_runs[1]["ample"]["microbatch_size"]

  def step_cost_refused_above_half(placed, rows, *, m, **kwargs):
    if m > whole // 2:
      raise jax.errors.JaxRuntimeError(VMEM_REFUSAL)
    return real(placed, rows, m=m, **kwargs)

  monkeypatch.setattr(step_cost, "step_cost", step_cost_refused_above_half)
  record, out = _dry_run_and_console(
      capsys, tmp_path / "run", "--gin.MICROBATCH_SIZE='auto'",
      "--gin.train.device_memory=64GiB")
  assert (f"auto sizing: microbatch {whole}, remat 'none': refused by the "
          "compiler: XLA:TPU compile permanent error. Ran out of memory in "
          "memory space vmem. Used 16.36M of 16.00M vmem.") in out
  assert record["fits"] and record["microbatch_size"] == whole // 2
  assert record["accumulation_calls"] == 2
  assert not (tmp_path / "run").exists()


SCANNED = ("--gin.MICROBATCH_SIZE='auto'", "--gin.train.device_memory=64GiB",
           "--gin.T5Config.scan_layers=True")


@pytest.fixture(scope="module")
def scanned(tmp_path_factory):
  """A dry run of the tiny T5 with scanned layers (its MODEL_DIR absent)."""
  model_dir = tmp_path_factory.mktemp("scanned") / "run"
  with pytest.MonkeyPatch.context() as mp:
    capture = _Capture(mp)
    try:
      train.main([*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--dry_run",
                  *SCANNED])
    finally:
      gin.clear_config()
  assert not model_dir.exists()
  return json.loads(capture.lines[-1])


def test_a_scanned_models_cost_is_its_loop_unrolled(dry_runs, scanned, capsys,
                                                    tmp_path):
  """`T5Config.scan_layers`: the step's FLOPs, extrapolated from the model
  at one and two layers per stack, are those XLA counts in the same model
  with its layer loop unrolled (`scan_unrolled`: straight-line code, which
  its analysis counts whole)."""
  straight = _dry_run(capsys, tmp_path / "straight", *SCANNED,
                      "--gin.T5Config.scan_unrolled=True")
  unrolled = dry_runs[1]["ample"]
  assert scanned["scan_layers"] and not straight["scan_layers"]
  assert (scanned["microbatch_size"], scanned["params"]) == (
      unrolled["microbatch_size"], unrolled["params"])
  # XLA's fusions differ slightly with the program's size (2e-6 measured);
  # a layer counted once would be off by about a quarter.
  assert scanned["flops_per_step"] == pytest.approx(straight["flops_per_step"],
                                                    rel=1e-5)
  assert scanned["bytes_accessed_per_step"] == pytest.approx(
      straight["bytes_accessed_per_step"], rel=0.05)
  assert scanned["cost_scaled_from_microbatch"] is None
  assert scanned["cost_per_layer_from"] == {"num_encoder_layers": 2,
                                            "num_decoder_layers": 2}
  assert scanned["fits"] and not os.listdir(tmp_path)


def test_refused_cost_programs_are_costed_at_a_smaller_microbatch(
    scanned, capsys, tmp_path, monkeypatch):
  """The loop-unrolled programs that cost a scanned model are compiled for
  their cost only: where a target's compiler refuses them for its memory,
  the plan stands (it fits by the loop's own compile) and they are costed
  at half the microbatch, or a quarter, and scaled. FLOPs are per example,
  so the scaled FLOPs are those costed at the whole microbatch. Refused at
  every size (here for a fusion's on-chip memory, as T5-XL's were on
  v4-32), the plan has no FLOPs and says why in one line."""
  real = step_cost.accumulate_cost
  tried = []
  hbm = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
         "required for HLO temporaries (15.94G) exceeds available HBM "
         "(15.75G).")

  def refused_above(limit, message=hbm):
    def accumulate_cost(*args, m, **kwargs):
      tried.append(m)
      if m > limit:
        raise jax.errors.JaxRuntimeError(message)
      return real(*args, m=m, **kwargs)
    return accumulate_cost

  m = scanned["microbatch_size"]
  monkeypatch.setattr(step_cost, "accumulate_cost", refused_above(m // 3))
  record = _dry_run(capsys, tmp_path / "scaled", *SCANNED)
  assert record["microbatch_size"] == m and record["fits"]
  assert record["cost_scaled_from_microbatch"] == m // 4
  assert tried[:2] == [m, m // 2]
  assert record["flops_per_step"] == pytest.approx(scanned["flops_per_step"],
                                                   rel=0.01)
  assert record["bytes_accessed_per_step"] > scanned["bytes_accessed_per_step"]

  monkeypatch.setattr(step_cost, "accumulate_cost",
                      refused_above(0, VMEM_REFUSAL))
  record, out = _dry_run_and_console(capsys, tmp_path / "refused", *SCANNED)
  assert ("could not compile the loop-unrolled programs that cost a scanned "
          f"model's layers at microbatch {m}: XLA:TPU compile permanent "
          "error. Ran out of memory in memory space vmem. Used 16.36M of "
          "16.00M vmem.") in out
  assert record["scan_layers"] and record["fits"]
  assert record["flops_per_step"] is None
  assert record["cost_scaled_from_microbatch"] is None
  assert record["peak_bytes_per_device"] > record["state_bytes_per_device"]
  assert not os.listdir(tmp_path)


def _run(model_dir, *flags) -> str:
  lines = []
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr("builtins.print", lambda *a, **k: lines.append(
        " ".join(str(x) for x in a)))
    try:
      # TINY's 4 steps: the σ the dry runs calibrated, found again.
      train.main([*TINY, f"--gin.MODEL_DIR='{model_dir}'", *flags])
    finally:
      gin.clear_config()
  return "\n".join(lines)


def _params(model_dir):
  mngr = checkpoints.manager(str(model_dir))
  try:
    params = checkpoints.restore_params(mngr, mngr.latest_step())
  finally:
    mngr.close()
  return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_the_automatic_choice_trains_as_the_hand_chosen_one(dry_runs, tmp_path):
  """Same secret, same steps: the run auto sizing picks (recorded in
  MODEL_DIR and taken from there on the rerun) ends with the params of the
  run given that microbatch by hand."""
  low = dry_runs[1]["low"]
  memory = low["device_memory_bytes"] / 0.9
  auto = tmp_path / "auto"
  out = _run(auto, "--gin.MICROBATCH_SIZE='auto'",
             f"--gin.train.device_memory={int(memory)}")
  with open(auto / sizing.FILENAME) as f:
    choice = json.load(f)["choice"]
  assert choice["microbatch_size"] == low["microbatch_size"]
  assert "auto sizing: microbatch" in out
  hand = tmp_path / "hand"
  _run(hand, f"--gin.MICROBATCH_SIZE={choice['microbatch_size']}")
  for a, b in zip(_params(auto), _params(hand), strict=True):
    np.testing.assert_array_equal(a, b)
  rerun = _run(auto, "--gin.MICROBATCH_SIZE='auto'",
               f"--gin.train.device_memory={int(memory)}")
  assert f"auto sizing (recorded in {auto})" in rerun


PAPER_GINS = sorted(os.path.basename(p) for p in glob.glob(
    os.path.join(REPO, "gin", "msmarco_t5_*_eps*.gin"))) + [
        "semparse_gpt2.gin", "textcls_distilgpt2.gin", "dialog_gpt2.gin",
        "dual_encoder_msmarco.gin", "dual_encoder_msmarco_dp.gin"]


@pytest.mark.parametrize("gin_file", PAPER_GINS)
def test_paper_gin_files_run_the_fast_path_with_pld(gin_file):
  """Every paper configuration: 'auto' clipping, microbatch and remat,
  bfloat16 compute (float32 params), the PLD accountant; T5-Large and XL
  with FSDP rules."""
  gin_cli.configure([gin_file], [])
  try:
    config = configurables.run_config()
    rules = partitioning.logical_axis_rules(config.axis_rules)
  finally:
    gin.clear_config()
  model = config.model_config
  compute = (model.encoder if hasattr(model, "encoder") else model)
  assert config.accountant == "pld" and config.clipping_method == "auto"
  assert config.microbatch_size == "auto"
  assert sizing.model_remat(model) == "auto" and compute.dtype == "bfloat16"
  big = "_large_" in gin_file or "_xl_" in gin_file
  assert (("embed", "fsdp") in rules) == big
  assert dataclasses.is_dataclass(model)


def test_the_xl_paper_gin_dry_runs_on_cpu(tmp_path, capsys):
  """gin/msmarco_t5_xl_eps3.gin as written but for the model's sizes and
  the batch (the 3B step takes many minutes to compile on a CPU;
  docs/benchmarks.md gives its plan): PLD plan, FSDP mesh, bf16, ghost
  clipping, auto sizing and the compiled cost, with nothing written."""
  record = _dry_run_gin(capsys, tmp_path / "xl", "msmarco_t5_xl_eps3.gin")
  assert record["accountant"] == "pld" and record["compute_dtype"] == "bfloat16"
  assert record["clipping_method"] == "ghost" and record["auto_sizing"]
  assert record["mesh"] == {"fsdp": 1} and record["remat"] in sizing.REMAT_ORDER
  # 'auto' keeps remat's memory: the second pass under it.
  assert record["ghost_summation"] == (
      "second_pass" if record["remat"] == "layer" else "book_keeping")
  assert record["n"] == 2998 and record["q"] == pytest.approx(32 / 2998)
  assert not os.path.exists(tmp_path / "xl")


def _dry_run_gin(capsys, model_dir, gin_file) -> dict:
  try:
    train.main([f"--gin_file={gin_file}", f"--gin.MODEL_DIR='{model_dir}'",
                "--gin.T5Config.num_encoder_layers=1",
                "--gin.T5Config.num_decoder_layers=1",
                "--gin.T5Config.vocab_size=2000", "--gin.T5Config.d_model=32",
                "--gin.T5Config.d_ff=64", "--gin.T5Config.num_heads=2",
                "--gin.T5Config.d_kv=16",
                # TINY's batch and steps: σ's calibration is remembered
                "--gin.BATCH_SIZE=32",
                "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
                "--gin.TRAIN_STEPS=4", "--dry_run"])
  finally:
    gin.clear_config()
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
