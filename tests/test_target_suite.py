"""`python -m dpjax.bench --suite=targets`: the comparison set the issue
names, the largest-batch search against brute force over a known memory
model, the time at that batch, and the targets recomputed by hand."""
import pytest

from dpjax.bench import target_suite as ts

GiB = 2**30
STATE = 3 * GiB  # the arguments' bytes: params, optimizer state
PER_EXAMPLE = {"nodp": 0.05 * GiB, "vmap": 0.4 * GiB, "ghost": 0.1 * GiB,
               "jax_privacy": 0.45 * GiB}
# Estimated seconds: accumulate per example, apply.
ACC = {"nodp": 1e-3, "vmap": 1.3e-3, "ghost": 1.05e-3, "jax_privacy": 1.4e-3}
APPLY = 2e-3
# The code generator's cycles: accumulate per example (ghost's passes count
# here, not in the seconds), apply.
CYCLES = {"nodp": 1.0e6, "vmap": 1.4e6, "ghost": 1.6e6, "jax_privacy": 1.5e6}
APPLY_CYCLES = 2e6


def fake_run(devices=4, refuse_over=None):
  """A `dpjax.bench --target` stand-in: the peak per device is affine in
  the batch per device (plus a little curvature, as XLA's is), a compile
  over `refuse_over` bytes fails as the TPU compiler's does."""
  calls = []

  def run(argv):
    args = dict(a[2:].split("=", 1) for a in argv if "=" in a)
    calls.append(argv)
    batch, mode = int(args["batch"]), args["mode"]
    per_device = batch / devices
    peak = int(STATE + PER_EXAMPLE[mode] * per_device
               + 1e4 * per_device**2)
    if refuse_over and peak > refuse_over:
      return {"error": "out of device memory: RESOURCE_EXHAUSTED: HLO "
                       "temporaries exceed available HBM",
              "num_devices": devices}
    line = {"batch": batch, "microbatch": batch, "num_devices": devices,
            "memory_analysis": {"argument_size_in_bytes": STATE,
                                "peak_estimate_bytes": peak},
            "flops": {"nodp": 1.0, "ghost": 1.13}.get(mode, 1.05) * batch,
            "bytes_accessed": 2.0 * batch}
    if "--no_cost" not in argv:
      acc = ACC[mode] * per_device
      line.update(step_time_estimate_s=acc + APPLY,
                  cycles=CYCLES[mode] * per_device + APPLY_CYCLES, cost_parts={
          "accumulate": {"seconds": acc, "cycles": CYCLES[mode] * per_device,
                         "flops": line["flops"]},
          "apply": {"seconds": APPLY, "cycles": APPLY_CYCLES, "flops": 0.0}})
    return line

  return run, calls


def brute_force(mode, limit, devices=4, cap=1024):
  """The largest power of two per device whose fake peak is under limit."""
  fits = [b for b in (2**i for i in range(11)) if b <= cap
          and STATE + PER_EXAMPLE[mode] * b + 1e4 * b**2 <= limit]
  return max(fits, default=None)


def test_the_suite_holds_the_issues_comparison_set():
  spec = ts.SUITES["targets"]
  assert {t.split(":")[1] for t in spec.targets} == {"v5e", "v4", "v6e",
                                                    "h100"}
  models = {m.name: m.args for m in spec.models}
  assert models["gpt2_small"] == ("--seq=256",)
  assert models["t5_base"] == ("--input_length=384", "--target_length=128")
  assert "--remat=layer" in models["t5_xl"] and "--seq=512" in models["t5_xl"]
  assert spec.batch == 32 and ts.MODES == ("nodp", "vmap", "ghost",
                                           "jax_privacy")


@pytest.mark.parametrize("memory", [16 * GiB, 32 * GiB, 95 * GiB])
@pytest.mark.parametrize("mode", sorted(PER_EXAMPLE))
def test_largest_batch_is_brute_forces_in_few_compiles(mode, memory):
  run, calls = fake_run()
  first = run(ts._argv(ts.SUITES["targets"], "tpu:v5e:2x2",
                       ts.SUITES["targets"].models[0], mode, 32))
  found = ts.largest_batch(
      run, lambda b: ("--mode=" + mode, f"--batch={b}", "--no_cost"), first,
      devices=4, memory_bytes=memory, headroom=0.9, max_per_device=1024)
  assert found["largest_batch_per_device"] == brute_force(mode, 0.9 * memory)
  assert len(calls) - 1 <= 3  # row 1 is not compiled again
  assert found["limit_bytes"] == int(0.9 * memory)


def test_a_refused_compile_does_not_fit():
  """The TPU compiler refuses a program over its HBM: no peak, no fit."""
  run, calls = fake_run(refuse_over=10 * GiB)
  first = run(("--mode=vmap", "--batch=32"))
  found = ts.largest_batch(
      run, lambda b: ("--mode=vmap", f"--batch={b}", "--no_cost"), first,
      devices=4, memory_bytes=32 * GiB, headroom=0.9, max_per_device=1024)
  assert found["largest_batch_per_device"] == brute_force("vmap", 10 * GiB)
  assert any("error" in s for s in found["search"])


def test_nothing_fits_is_none():
  run, _ = fake_run()
  first = run(("--mode=vmap", "--batch=32"))
  found = ts.largest_batch(
      run, lambda b: ("--mode=vmap", f"--batch={b}", "--no_cost"), first,
      devices=4, memory_bytes=2 * GiB, headroom=0.9, max_per_device=1024)
  assert found["largest_batch_per_device"] is None


def test_step_seconds_scale_accumulate_not_apply():
  row = {"microbatch": 32, "cost_parts": {"accumulate": {"seconds": 0.01},
                                          "apply": {"seconds": 0.002}}}
  assert ts.step_seconds(row, 128) == pytest.approx(0.04 + 0.002)
  row["cost_parts"]["apply"]["seconds"] = None  # no estimate (a GPU)
  assert ts.step_seconds(row, 128) is None


def test_suite_results_and_targets_recomputed_by_hand():
  spec = ts.SUITES["targets"]._replace(
      targets=("tpu:v5e:2x2", "gpu:h100:1x1"),
      models=ts.SUITES["targets"].models[:1])
  run, _ = fake_run()
  memory = {"tpu:v5e:2x2": 16 * GiB, "gpu:h100:1x1": 80 * GiB}
  kept = []
  results = ts.run_suite(spec, headroom=0.9, run=run, memory_of=memory.get,
                         keep=kept.append)
  assert kept == results and len(results) == 2 * 4
  met = {}  # per target and model: its targets' (name, value, met, note)
  for where, *rest in ts.targets_met(spec, results):
    met.setdefault(where, []).append(tuple(rest))
  for target in spec.targets:
    by_mode = {r["suite_mode"]: r for r in results
               if r["suite_target"] == target}
    step = (by_mode["ghost"]["step_time_estimate_s"]
            / by_mode["nodp"]["step_time_estimate_s"])
    # ghost: 8 per device at 1.05 ms each + apply, over nodp's 1 ms each.
    assert step == pytest.approx((8 * 1.05e-3 + APPLY) / (8e-3 + APPLY))
    by_estimate, by_cycles, by_throughput = met[f"{target} gpt2_small"]
    assert by_estimate == ("ghost step <= 1.10x nodp (TPU estimate)",
                           pytest.approx(step), step <= 1.10, "")
    cycles = (8 * CYCLES["ghost"] + APPLY_CYCLES) / (8 * CYCLES["nodp"]
                                                     + APPLY_CYCLES)
    assert by_cycles == ("ghost step <= 1.10x nodp (TPU cycles)",
                         pytest.approx(cycles), cycles <= 1.10, "")

    def rate(mode):
      b = brute_force(mode, 0.9 * memory[target])
      return 4 * b / (ACC[mode] * b + APPLY)
    assert by_mode["ghost"]["examples_per_s_at_largest"] == pytest.approx(
        rate("ghost"))
    throughput = rate("ghost") / rate("jax_privacy")
    _, value, ok, note = by_throughput
    assert (value, ok) == (pytest.approx(throughput), throughput >= 3)
    # The ceiling: nodp's own rate at its largest batch over jax-privacy's.
    assert note == f"nodp's own: {rate('nodp') / rate('jax_privacy'):.3f}x"
  table = ts.table(spec, results, "python -m dpjax.bench --suite=targets")
  assert table.count("| `tpu:v5e:2x2` | gpt2_small |") == 4


def test_cycles_counted_two_ways_are_not_compared():
  """A scanned row's cycles are its loop program's where the text gives
  every loop's trip count, else extrapolated from the unrolled programs:
  ghost's from its loop over nodp's extrapolated is no ratio (n/a)."""
  loop = {"cost_parts": {"accumulate": {"cycles_of": "loop program"}}}
  rows = [dict(suite_target="t", suite_model="m", suite_mode=mode,
               cycles=cycles, **extra)
          for mode, cycles, extra in (("nodp", 2.0, {}), ("ghost", 3.0, loop),
                                      ("vmap", 5.0, {}))]
  assert ts.ratio(rows, rows[1], "cycles") is None
  assert ts.ratio(rows, rows[2], "cycles") == 2.5
  rows[0].update(loop)
  assert ts.ratio(rows, rows[1], "cycles") == 1.5


def test_a_fitting_top_is_doubled_until_one_does_not_fit():
  """The line through row 1 can underestimate the largest batch (a
  compiler's peak may grow slower than linearly): the search goes on up."""
  run, _ = fake_run()
  first = run(("--mode=ghost", "--batch=32"))
  first["memory_analysis"]["peak_estimate_bytes"] *= 3  # a pessimistic line
  found = ts.largest_batch(
      run, lambda b: ("--mode=ghost", f"--batch={b}", "--no_cost"), first,
      devices=4, memory_bytes=32 * GiB, headroom=0.9, max_per_device=1024)
  assert found["largest_batch_per_device"] == brute_force("ghost", 0.9 * 32 * GiB)


def test_resume_reuses_rows_and_compiles():
  spec = ts.SUITES["targets"]._replace(targets=("tpu:v5e:2x2",),
                                       models=ts.SUITES["targets"].models[:1])
  run, calls = fake_run()
  memory = {"tpu:v5e:2x2": 16 * GiB}.get
  first = ts.run_suite(spec, headroom=0.9, run=run, memory_of=memory)
  n = len(calls)
  again = ts.run_suite(spec, headroom=0.9, run=run, memory_of=memory,
                       done=first[:3])  # the last mode was not finished
  assert again[:3] == first[:3] and again[3] == first[3]
  assert len(calls) - n == 1 + len(first[3]["search"])  # its row 1, search


def test_targets_of_rows_not_run_are_not_applicable():
  spec = ts.SUITES["targets"]._replace(targets=("tpu:v5e:2x2",),
                                       models=ts.SUITES["targets"].models[:1])
  run, _ = fake_run()
  results = ts.run_suite(spec, headroom=0.9, run=run,
                         memory_of={"tpu:v5e:2x2": 16 * GiB}.get)
  partial = [r for r in results if r["suite_mode"] != "ghost"]
  assert [met for *_, met, _ in ts.targets_met(spec, partial)] == [None] * 3
  assert "| n/a |" in ts.table(spec, partial, "python -m dpjax.bench")


def test_scan_layers_scans_the_scannable_models_only():
  args = ts.parse_args(["--suite=targets", "--targets=tpu:v5e:2x2",
                        "--scan_layers"])
  spec = ts.select(ts.SUITES["targets"], args)
  run, calls = fake_run()
  ts.run_suite(spec, headroom=0.9, run=run,
               memory_of={"tpu:v5e:2x2": 16 * GiB}.get)
  scans = {}
  for argv in calls:
    model = next(a.split("=")[1] for a in argv if a.startswith("--model="))
    scans.setdefault(model, set()).add(argv.count("--scan_layers"))
  assert scans == {"gpt2_small": {0}, "t5_base": {1}, "t5_xl": {1}}
  unscanned = ts.select(ts.SUITES["targets"], ts.parse_args(
      ["--suite=targets"]))
  assert [m.args.count("--scan_layers") for m in unscanned.models] == [0, 0, 1]


@pytest.mark.parametrize("flag, message", [
    ("--targets=tpu:v9:2x2", "--target 'tpu:v9:2x2': expected one of"),
    ("--models=gpt2_huge", "--models: ['gpt2_huge'] not in the suite's"),
    ("--modes=ghost,opacus", "--modes: ['opacus'] not in ('nodp'"),
])
def test_a_bad_target_or_model_is_one_line_and_exit_2(flag, message, capsys,
                                                     tmp_path):
  out = tmp_path / "rows.jsonl"
  assert ts.main(["--suite=targets", flag, f"--json_out={out}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: ") and message in err[-1]
  assert not out.exists()


def largest_compiled(mode, refuse_over, batch=32, devices=4):
  """The largest power-of-two fraction of `batch`, at least one example a
  device, whose fake step the fake compiler does not refuse."""
  fits = [b for b in (batch >> i for i in range(batch.bit_length()))
          if b >= devices and STATE + PER_EXAMPLE[mode] * (b / devices)
          + 1e4 * (b / devices)**2 <= refuse_over]
  return max(fits, default=None)


@pytest.mark.parametrize("mode", sorted(PER_EXAMPLE))
def test_a_refused_row_is_compiled_at_the_largest_batch_that_fits(mode):
  """T5-XL's DP steps do not fit a 2x2 slice at 32: row 1 halves the batch
  until the compiler takes it, and says what it refused."""
  refuse_over = STATE + 1.1 * GiB  # vmap: 2 a device, nodp: all 8
  run, calls = fake_run(refuse_over=refuse_over)
  row = ts.fitting_row(lambda b: run(("--mode=" + mode, f"--batch={b}")), 32)
  want = largest_compiled(mode, refuse_over)
  assert row["batch"] == want and "error" not in row
  tried = [int(dict(a[2:].split("=") for a in argv)["batch"]) for argv in calls]
  assert tried == [32 >> i for i in range(len(tried))] and tried[-1] == want
  assert [r["batch"] for r in row.get("refused", [])] == tried[:-1]
  assert all(r["error"].startswith("out of device memory")
             for r in row.get("refused", []))


def test_a_row_refused_at_one_example_a_device_or_failing_otherwise_stays():
  run, calls = fake_run(refuse_over=STATE)  # nothing fits
  row = ts.fitting_row(lambda b: run(("--mode=nodp", f"--batch={b}")), 32)
  assert row["error"].startswith("out of device memory")
  assert [r["batch"] for r in row["refused"]] == [32, 16, 8]  # then 4: 1 each
  assert len(calls) == 4
  other = ts.fitting_row(lambda b: {"error": "exit 1: a bug",
                                    "num_devices": 4}, 32)
  assert other == {"error": "exit 1: a bug", "num_devices": 4}  # not halved


def test_at_batch_scales_accumulate_not_apply():
  run, _ = fake_run()
  nodp = run(("--mode=nodp", "--batch=32"))
  assert ts.at_batch(nodp, "flops", 32) == nodp["flops"]
  for field, acc, apply in (("step_time_estimate_s", ACC["nodp"], APPLY),
                            ("cycles", CYCLES["nodp"], APPLY_CYCLES)):
    # 16 over 4 devices: 4 a device, each at accumulate's per-example cost.
    assert ts.at_batch(nodp, field, 16) == pytest.approx(4 * acc + apply)
  assert ts.at_batch(nodp, "flops", 16) == pytest.approx(16.0)
  del nodp["cost_parts"]["apply"]["cycles"]
  assert ts.at_batch(nodp, "cycles", 16) is None


def test_a_row_that_fit_only_a_smaller_batch_is_compared_with_nodp_there():
  spec = ts.SUITES["targets"]._replace(targets=("tpu:v5e:2x2",),
                                       models=ts.SUITES["targets"].models[:1])
  refuse_over = STATE + 0.5 * GiB  # ghost: 4 a device (16), nodp: 8 (32)
  run, _ = fake_run(refuse_over=refuse_over)
  results = ts.run_suite(spec, headroom=0.9, run=run,
                         memory_of={"tpu:v5e:2x2": 16 * GiB}.get)
  by_mode = {r["suite_mode"]: r for r in results}
  ghost, nodp = by_mode["ghost"], by_mode["nodp"]
  assert (ghost["batch"], nodp["batch"]) == (16, 32)
  assert ghost["argv"] == list(ts._argv(spec, "tpu:v5e:2x2", spec.models[0],
                                        "ghost", 32))  # --resume's key
  step = (4 * ACC["ghost"] + APPLY) / (4 * ACC["nodp"] + APPLY)
  cycles = ((4 * CYCLES["ghost"] + APPLY_CYCLES)
            / (4 * CYCLES["nodp"] + APPLY_CYCLES))
  assert ts.ratio(results, ghost, "step_time_estimate_s") == pytest.approx(step)
  assert ts.ratio(results, ghost, "flops") == pytest.approx(1.13)
  by_estimate, by_cycles, _ = ts.targets_met(spec, results)
  assert by_estimate[2:] == (pytest.approx(step), step <= 1.10,
                             "at ghost's batch 16, nodp's step scaled to it")
  assert by_cycles[2] == pytest.approx(cycles)
  table = ts.table(spec, results, "python -m dpjax.bench --suite=targets")
  assert "refused at 32 (out of memory)" in table
  # The largest batch is searched from the row that fit, as from any row 1.
  assert ghost["largest_batch_per_device"] == brute_force(
      "ghost", min(0.9 * 16 * GiB, refuse_over))


def test_modes_narrow_the_suite_in_its_own_order():
  args = ts.parse_args(["--suite=targets", "--modes=ghost,nodp",
                        "--targets=tpu:v5e:2x2", "--models=gpt2_small"])
  spec = ts.select(ts.SUITES["targets"], args)
  assert spec.modes == ("nodp", "ghost")
  run, calls = fake_run()
  results = ts.run_suite(spec, headroom=0.9, run=run,
                         memory_of={"tpu:v5e:2x2": 16 * GiB}.get)
  assert [r["suite_mode"] for r in results] == ["nodp", "ghost"]
  assert {dict(a[2:].split("=", 1) for a in argv if "=" in a)["mode"]
          for argv in calls} == {"nodp", "ghost"}
  by_estimate, _, by_throughput = ts.targets_met(spec, results)
  # No jax-privacy row: its target is not applicable.
  assert by_estimate[3] is not None and by_throughput[3] is None
