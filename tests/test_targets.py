"""Planning on the hardware a run will use: `--dry_run --target=...`
compiles the run for a TPU slice (libtpu) or GPUs (jax's CUDA plugin and
the host's ptxas) on this CPU host, both in the test extra, sized to the
target's memory, and refuses what does not fit it; its peak is XLA's own
memory analysis of the same step compiled for the same devices."""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re

import gin
import jax
import numpy as np
import pytest

from dpjax.training import dry_run, step_cost, targets, trainer
from dpjax import configurables
from dpjax import errors, gin_cli, train

GiB = 2**30
TINY = [  # the quickstart's tiny T5, one layer each, short rows, 4 steps of
    # 8 examples (Poisson: a padded batch of 16; a TPU compile takes longer
    # the larger it is)
    "INITIAL_CHECKPOINT_PATH = None", "T5Config.vocab_size = 2000",
    "T5Config.num_encoder_layers = 1", "T5Config.num_decoder_layers = 1",
    "TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 8}",
    "BATCH_SIZE = 8", "TRAIN_STEPS = 4", "train.eval_period = 0",
    "train.generate_after_training = False"]


def configure(model_dir, *extra) -> None:
  gin.clear_config()
  gin_cli.configure(["quickstart.gin"],
                    [f"MODEL_DIR = '{model_dir}'", *TINY, *extra])
  configurables.register_tasks(configurables.run_config())


# `targets.resolve` (the library's, bound before any patch), once a spec.
shared_target = functools.cache(targets.resolve)


@contextlib.contextmanager
def one_target_per_spec():
  """Dry runs resolve each spec to `shared_target`'s Target. A topology's
  devices are new objects on every call, and the steps placed on a mesh
  (`step.place_steps`' memo) and their executables (jax's in-memory
  caches) are reused only on the same devices: the v5e fixture's programs,
  compiled again for the refusal and the peak below (the same run at its
  chosen microbatch), are then compiled once."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(targets, "resolve", shared_target)
    yield


# Ghost clipping through remat layers: the sizing weighs book-keeping
# against the second pass.
GHOST_REMAT = ["T5Config.remat = 'layer'", "train.clipping_method = 'ghost'"]


@pytest.fixture(scope="module")
def v5e(tmp_path_factory):
  """A dry run of the tiny quickstart (`GHOST_REMAT`) for a v5e 2x2 slice,
  its microbatch and ghost summation sized automatically, and what it
  said on the console."""
  model_dir = tmp_path_factory.mktemp("v5e") / "run"
  configure(model_dir, "MICROBATCH_SIZE = 'auto'", *GHOST_REMAT)
  console = io.StringIO()
  with one_target_per_spec(), contextlib.redirect_stdout(console):
    line = dry_run.dry_run(configurables.run_config(), target="tpu:v5e:2x2")
  return model_dir, line, console.getvalue()


def chosen(line) -> list[str]:
  """The bindings that plan the fixture's run without a search."""
  return [f"MICROBATCH_SIZE = {line['microbatch_size']}", *GHOST_REMAT,
          f"train.ghost_summation = '{line['ghost_summation']}'"]


def test_the_plan_is_for_the_slices_devices_and_memory(v5e):
  model_dir, line, _ = v5e
  assert (line["backend"], line["device_kind"], line["devices"]) == (
      "tpu", "TPU v5 lite", 4)
  assert line["mesh"] == {"data": 4} and line["chips"] == 4
  # Sized against the slice's HBM (16 GiB a chip), not this host's memory.
  assert line["device_memory_bytes"] == int(
      16 * GiB * configurables.run_config().memory_headroom)
  assert line["device_memory_source"] == "tpu:v5e:2x2 HBM per device"
  assert line["auto_sizing"] and line["fits"]
  assert line["microbatch_size"] % 4 == 0 and line["accumulation_calls"] == 1
  assert 0 < line["peak_bytes_per_device"] <= line["device_memory_bytes"]
  # The compiler's own time estimate of k x accumulate + apply, and the run.
  assert line["step_time_estimate_s"] > 0
  assert line["step_cycles_estimate"] > 0  # its code generator's, per op
  assert line["projected_wall_s"] == pytest.approx(
      4 * line["step_time_estimate_s"])
  assert 0 < line["mfu"] < 1
  assert not os.path.exists(model_dir)  # a dry run writes nothing


def test_the_peak_is_xlas_memory_analysis_for_the_same_devices(v5e, tmp_path):
  """The run's two halves lowered here, over a mesh of the topology's
  devices, and XLA's memory analysis of them: arguments + outputs +
  temporaries - aliases, the optimizer state resident during accumulate.
  On the fixture's devices, a program the dry run compiled comes from
  jax's cache; any other (another microbatch, layout or step) compiles
  here."""
  from jax.experimental import topologies
  _, line, _ = v5e
  m = line["microbatch_size"]
  configure(tmp_path / "run", *chosen(line))
  devices = topologies.get_topology_desc(
      platform="tpu", topology_name="v5e:2x2").devices
  with targets.without_persistent_cache():
    built = trainer.build(configurables.run_config(), dry_run=True,
                          target=shared_target("tpu:v5e:2x2"))
  assert [(d.id, d.device_kind) for d in built.mesh.devices.flat] == [
      (d.id, d.device_kind) for d in devices]
  placed, k = built.placed, line["accumulation_calls"]
  # The step's own shardings are on these device objects: a topology's
  # devices are new objects on every call.
  mesh = jax.sharding.Mesh(built.mesh.devices.reshape(-1), ("data",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      None, "data"))
  one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch = {f: jax.ShapeDtypeStruct((k, m, *x.shape), x.dtype, sharding=rows)
           for f, x in built.batch_rows.items()}
  mask = jax.ShapeDtypeStruct((k, m), np.float32, sharding=rows)
  index = jax.ShapeDtypeStruct((), np.int32, sharding=one)
  state = placed.abstract_state
  grads = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(placed.zero_sums, state.params), placed.sums_shardings)

  def peak(compiled) -> int:
    a = compiled.memory_analysis()
    return (a.argument_size_in_bytes + a.output_size_in_bytes
            + a.temp_size_in_bytes - a.alias_size_in_bytes)

  with targets.without_persistent_cache():
    accumulate = placed.accumulate.lower(state.params, grads, batch, mask,
                                         index, index,
                                         state.clip_norms).compile()
    apply = placed.apply.lower(
        state, grads, jax.ShapeDtypeStruct((4,), np.uint32, sharding=one),
        jax.ShapeDtypeStruct((), np.float32, sharding=one)).compile()
  optimizer_state = sum(  # what accumulate does not take but stays resident
      int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
      for x in jax.tree.leaves((state.opt_state, state.step,
                                state.noise_count)))
  assert line["peak_bytes_per_device"] == max(peak(accumulate)
                                              + optimizer_state, peak(apply))


def _refused(capsys, argv) -> str:
  with pytest.raises(SystemExit) as e:
    gin_cli.exit_on_user_error(lambda: train.main(argv), train.user_errors())
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1, err
  return err


def test_on_a_tpu_the_sizing_takes_the_least_estimated_step(v5e):
  """Where the compiler estimates time, the sizing costs each variant's
  largest fitting microbatch (under remat: book-keeping, the second pass)
  and plans the least estimate, which is the planned step's own."""
  _, line, console = v5e
  costed = {summation or "auto": float(seconds)
            for summation, seconds in re.findall(
                r"auto sizing: microbatch \d+, remat 'layer'(?:, ghost "
                r"summation '(\w+)')?: estimated (\S+) s a step", console)}
  assert set(costed) == {"book_keeping", "auto"}
  least = min(costed, key=costed.get)
  assert line["ghost_summation"] == (
      "second_pass" if least == "auto" else "book_keeping")
  assert line["step_time_estimate_s"] == pytest.approx(costed[least],
                                                       rel=1e-3)


def test_a_run_that_does_not_fit_the_slice_is_refused_with_the_numbers(
    v5e, tmp_path, capsys):
  gin.clear_config()
  argv = ["--gin_file=quickstart.gin", f"--gin.MODEL_DIR='{tmp_path / 'r'}'",
          *(f"--gin.{b.replace(' = ', '=', 1)}" for b in TINY),
          # The v5e fixture's choice: its programs (`one_target_per_spec`)
          *(f"--gin.{b.replace(' = ', '=', 1)}" for b in chosen(v5e[1])),
          "--gin.train.memory_headroom=1e-5",
          "--dry_run", "--target=tpu:v5e:2x2"]
  with one_target_per_spec():
    err = _refused(capsys, argv)
  assert "does not fit tpu:v5e:2x2: peak" in err
  assert "GiB per device at microbatch 16" in err
  assert "0.00 GiB usable (tpu:v5e:2x2 HBM per device x " in err
  assert os.listdir(tmp_path) == []


def test_a_gpu_plan_is_for_the_gpus_and_their_memory(tmp_path):
  # The whole padded batch in one call: one accumulate compiled.
  configure(tmp_path / "run", "MICROBATCH_SIZE = None")
  line = dry_run.dry_run(configurables.run_config(), target="gpu:h100:1x2")
  assert (line["backend"], line["device_kind"], line["devices"]) == (
      "gpu", "NVIDIA H100 80GB HBM3", 2)
  assert line["mesh"] == {"data": 2}
  assert line["device_memory_bytes"] == int(
      81559 * 2**20 * configurables.run_config().memory_headroom)
  assert line["fits"] and line["peak_bytes_per_device"] > 0
  assert line["flops_per_step"] > 0  # the optimized module's, generically
  assert line["step_time_estimate_s"] is None  # the GPU compiler gives none
  assert line["step_cycles_estimate"] is None
  assert not (tmp_path / "run").exists()


def test_the_generic_cost_of_a_gpu_program_counts_its_flops():
  from jax.experimental import topologies
  devices = topologies.get_topology_desc(
      platform="cuda", target_config=targets.gpu_target_config("h100"),
      topology="1x1x1").devices
  one = jax.sharding.SingleDeviceSharding(devices[0])
  x = jax.ShapeDtypeStruct((512, 512), jax.numpy.bfloat16, sharding=one)
  with targets.without_persistent_cache():
    compiled = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
  assert compiled.cost_analysis() is None
  cost = step_cost.cost_analysis(compiled)
  assert cost["flops"] == pytest.approx(2 * 512**3, rel=0.01)  # and converts
  assert cost["seconds"] is None
  assert cost["bytes_accessed"] >= 3 * 512 * 512 * 2  # two inputs, an output


@pytest.mark.parametrize("args, message", [
    (["--target=tpu:v5e:2x2"], "use it with --dry_run"),
    (["--dry_run", "--target=tpu:v9:2x2"], "expected one of tpu:v4:2x2x2"),
    (["--dry_run", "--target=gpu:rtx9000"], "gpu:h100[:1x8]"),
    (["--dry_run", "--target=gpu:h100:8"], "gpu:NAME:HOSTSxGPUS has 2"),
    (["--dry_run", "--target=tpu:v5e:2x2x1"], "a v5e topology has 2 dimensions"),
    (["--dry_run", "--target=tpu:v5e:3x3"], "not divisible"),
    (["--dry_run", "--dry_run_steps=2", "--target=tpu:v5e:2x2"],
     "use one or the other"),
])
def test_bad_targets_are_one_line(tmp_path, capsys, args, message):
  gin.clear_config()
  argv = ["--gin_file=quickstart.gin", f"--gin.MODEL_DIR='{tmp_path / 'r'}'",
          *args]
  assert message in _refused(capsys, argv)
  assert os.listdir(tmp_path) == []


def test_without_libtpu_the_line_names_the_extra(monkeypatch):
  from jax.experimental import topologies

  def missing(**_):
    raise RuntimeError("JAX TPU support not installed; cannot generate TPU "
                       "topology.")

  monkeypatch.setattr(topologies, "get_topology_desc", missing)
  with pytest.raises(errors.UsageError, match=r'pip install -e "\.\[tpu\]"'):
    targets.resolve("tpu:v5e:2x2")

  def no_plugin(**_):
    raise NotImplementedError("topology not implemented for cuda")

  monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
  with pytest.raises(errors.UsageError,
                     match=r'pip install "jax\[cuda12-local\]"'):
    targets.resolve("gpu:h100")


def test_cost_of_a_loop_free_program_carries_the_tpu_estimate():
  from jax.experimental import topologies
  devices = topologies.get_topology_desc(platform="tpu",
                                         topology_name="v5e:2x2").devices
  one = jax.sharding.SingleDeviceSharding(devices[0])
  x = jax.ShapeDtypeStruct((1024, 1024), jax.numpy.bfloat16, sharding=one)
  with targets.without_persistent_cache():
    compiled = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
  cost = step_cost.cost_analysis(compiled)
  assert cost["flops"] == pytest.approx(2 * 1024**3, rel=0.01)
  # at least the FLOPs at the chip's peak, at most 100x that
  floor = cost["flops"] / targets.TPU_CHIPS["v5e"].peak_bf16_flops
  assert floor <= cost["seconds"] < 100 * floor
  json.dumps(cost)  # plain numbers


def test_a_loops_cycles_count_each_iteration():
  """A layer loop (`lax.scan` over stacked weights) compiled for a v5e: its
  cycles grow by the same amount with each added iteration (loops of 4, 6
  and 8 layers; the compiler places a loop of 2's weights otherwise), and
  exceed the ops' estimates summed over the text, which count the body
  once whatever the trip count."""
  from jax.experimental import topologies
  devices = topologies.get_topology_desc(platform="tpu",
                                         topology_name="v5e:2x2").devices
  one = jax.sharding.SingleDeviceSharding(devices[0])
  layer = lambda x, w: (jax.numpy.tanh(x @ w), None)
  x = jax.ShapeDtypeStruct((512, 512), jax.numpy.bfloat16, sharding=one)
  cycles, summed = {}, {}
  for layers in (4, 6, 8):
    ws = jax.ShapeDtypeStruct((layers, 512, 512), jax.numpy.bfloat16,
                              sharding=one)
    with targets.without_persistent_cache():
      compiled = jax.jit(lambda x, ws: jax.lax.scan(layer, x, ws)[0]).lower(
          x, ws).compile()
    cost = step_cost.cost_analysis(compiled)
    assert cost["while_loops"] == 1 and cost["seconds"] is None
    cycles[layers] = cost["cycles"]
    summed[layers] = sum(int(c) for c in re.findall(
        r'"estimated_cycles":"(\d+)"', compiled.as_text()))
  assert cycles[8] - cycles[6] == cycles[6] - cycles[4] > 0
  assert summed[4] == summed[8] < cycles[4] < cycles[8]


def test_windowed_einsum_loops_are_compiled_out_of_a_tpu_cost():
  """The gradient of an FSDP matmul over 32 v4 chips: the TPU compiler
  splits it into windowed-einsum loops, whose bodies XLA counts once and
  whose time it does not estimate; `loop_free_cost` compiles the program
  without them, whose FLOPs are the matmuls' (2 MKN each, forward and the
  weight gradient, per chip) and which has an estimate."""
  mesh = jax.sharding.Mesh(np.array(shared_target("tpu:v4:2x2x4").devices),
                           ("fsdp",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  m, k, n = 4096, 1024, 4096
  x = jax.ShapeDtypeStruct((m, k), jax.numpy.bfloat16, sharding=rows)
  w = jax.ShapeDtypeStruct((k, n), jax.numpy.bfloat16, sharding=rows)
  grad = jax.jit(jax.grad(lambda w, x: jax.numpy.sum(
      (x @ w).astype(np.float32)**2)), out_shardings=rows)
  lowered = grad.lower(w, x)
  with targets.without_persistent_cache():
    compiled = lowered.compile()
    windowed = step_cost.cost_analysis(compiled)
    cost = step_cost.loop_free_cost(lowered, mesh, compiled)
  assert windowed["windowed_einsum_loops"] == windowed["while_loops"] > 0
  assert windowed["seconds"] is None
  assert cost["while_loops"] == 0 and cost["windowed_einsum"] is False
  matmuls = 2 * (2 * m * k * n) / 32
  assert matmuls <= cost["flops"] < 1.01 * matmuls
  assert windowed["flops"] < 0.9 * matmuls  # a loop's body counted once
  floor = cost["flops"] / targets.TPU_CHIPS["v4"].peak_bf16_flops
  assert floor <= cost["seconds"] < 100 * floor


@pytest.mark.parametrize("accelerator, topology", [
    ("v4-8", "tpu:v4:2x2x1"), ("v4-32", "tpu:v4:2x2x4"),
    ("v4-256", "tpu:v4:4x4x8"), ("v4-512", "tpu:v4:4x8x8"),
    ("v5p-128", "tpu:v5p:4x4x4"), ("v5litepod-1", "tpu:v5e:1x1"),
    ("v5litepod-8", "tpu:v5e:2x4"), ("v5litepod-128", "tpu:v5e:8x16"),
    ("v6e-256", "tpu:v6e:16x16")])
def test_cloud_accelerator_types_are_their_default_topologies(accelerator,
                                                              topology):
  """The slice shapes of Cloud TPU's documentation for each type."""
  assert targets.accelerator_topology(accelerator) == topology
  assert targets.parse(f"tpu:{accelerator}") == targets.parse(topology)


def test_the_pod_preflight_refuses_an_oversized_run_before_creating_anything(
    tmp_path):
  """launch/tpu_pod.sh --preflight compiles the run for the slice here; one
  that does not fit ends the script (exit 2) before any gcloud command."""
  import subprocess
  proc = subprocess.run(
      ["bash", "launch/tpu_pod.sh", "--name=n", "--zone=z",
       "--accelerator_type=v5litepod-4", "--preflight", "--dry-run", "--",
       "--gin_file=quickstart.gin",
       *(f"--gin.{b.replace(' = ', '=', 1)}" for b in TINY),
       "--gin.MICROBATCH_SIZE=16", "--gin.train.memory_headroom=1e-5"],
      capture_output=True, text=True, cwd=os.path.dirname(
          os.path.dirname(os.path.abspath(__file__))), timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "does not fit tpu:v5litepod-4: peak" in proc.stderr
  assert "the preflight refused the run on v5litepod-4" in proc.stderr
  assert "gcloud" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("target, platform, kind, devices", [
    ("tpu:v5e:2x2", "tpu", "TPU v5 lite", 4),
    ("gpu:h100:1x2", "gpu", "NVIDIA H100 80GB HBM3", 2)])
def test_the_bench_compiles_a_dp_step_for_a_target(capsys, target, platform,
                                                   kind, devices):
  """`python -m dpjax.bench --target`: the target's memory analysis and
  cost (DP against nodp by its compiler), nothing run."""
  from dpjax.bench import step as bench
  assert bench.main(["--model=gpt2_tiny", "--layers=1", "--vocab=128",
                     "--seq=16", "--batch=8", "--microbatch=8",
                     "--mode=ghost", "--compare_nodp",
                     f"--target={target}"]) == 0
  line = json.loads(capsys.readouterr().out)
  assert (line["platform"], line["device_kind"], line["num_devices"]) == (
      platform, kind, devices)
  assert line["target"] == target and "step_time_s" not in line
  assert line["mesh"] == {"data": devices}
  assert line["memory_analysis"]["peak_estimate_bytes"] > 0
  assert line["flops_vs_nodp"] > 1 and line["bytes_vs_nodp"] > 1
  if platform == "tpu":
    assert line["step_time_estimate_s"] > 0
  else:
    assert line["step_time_estimate_s"] is None


def test_fsdp_activations_are_split_along_the_batch(capsys, monkeypatch):
  """FSDP over 32 v4 chips splits the weights along 'embed'; left to
  itself, the TPU compiler's partitioner followed them, splitting the
  activations along their hidden axis and computing all 32 examples on
  every chip. With them split along the batch (`common.along_batch`), the
  tiny T5's ghost accumulate moves about a third fewer bytes a chip and
  its compiler estimates it faster than the same step without the
  constraint (measured: 6.5e7 against 1.26e8 bytes, 0.13 against 0.26 ms)."""
  from dpjax.bench import step as bench
  from dpjax.models import common

  def accumulate_cost():
    assert bench.main(["--model=t5_tiny", "--vocab=2000", "--layers=1",
                       "--input_length=48", "--target_length=16",
                       "--batch=32", "--mode=ghost", "--cost_only",
                       "--rules=fsdp", "--mesh=fsdp:32",
                       "--target=tpu:v4:2x2x4"]) == 0
    return json.loads(capsys.readouterr().out)["cost_parts"]["accumulate"]

  split = accumulate_cost()
  monkeypatch.setattr(common, "along_batch", lambda x: x)
  followed = accumulate_cost()
  assert split["flops"] == pytest.approx(followed["flops"], rel=0.05)
  assert split["bytes_accessed"] < 0.8 * followed["bytes_accessed"]
  assert split["seconds"] < 0.8 * followed["seconds"]


def test_an_example_under_vmap_is_kept_whole():
  """Under vmap (per-example gradients) an activation is one example: its
  leading axis is a position. It is kept whole; the per-example passes'
  vmapped axis (`clipping.vmap_examples`) is split as the batch is, where
  the batch divides over the devices, and left to the partitioner where it
  does not. Split like a batch, the positions would take the data-parallel
  devices from the examples (a reshard a layer, which ghost's FSDP steps
  did before). Where only the batch is split, nothing is constrained."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from dpjax.models import common
  from dpjax.privacy import clipping
  from dpjax.training import partitioning

  devices = np.array(shared_target("tpu:v5e:2x2").devices)

  def constraints(fn, examples=8, rules="fsdp", axis="fsdp"):
    mesh = Mesh(devices, (axis,))
    batch = jax.ShapeDtypeStruct((examples, 16, 4), np.float32,
                                 sharding=NamedSharding(mesh, P()))
    laid_out = partitioning.batch_laid_out(fn, mesh,
                                           partitioning.RULE_SETS[rules])
    text = jax.jit(laid_out).lower(batch).as_text()
    return [line.split("<@mesh, ")[1].split(">")[0]
            for line in text.splitlines() if "sdy.sharding_constraint" in line]

  layer = lambda x: common.along_batch(2 * x)
  assert constraints(layer) == ['[{"fsdp"}, {}, {}]']
  assert constraints(jax.vmap(layer)) == ["[{?}, {}, {}]"]
  per_example = clipping.vmap_examples(layer, in_axes=0)
  assert constraints(per_example) == ['[{"fsdp"}, {}, {}]']
  assert constraints(per_example, examples=6) == ["[{?}, {}, {}]"]
  # Data parallel: the parameters are whole, the partitioner follows the
  # batch, and constraints would only cost fusions.
  assert constraints(per_example, rules="data_parallel", axis="data") == []
  assert constraints(layer, rules="data_parallel", axis="data") == []


def test_a_scanned_sites_norms_read_its_factors_where_the_loop_put_them():
  """A scanned site's factors leave the layer loop stacked layers
  outermost. Ghost's norms batch their products over the layers outside
  the examples, and take whole `[T, T]` Grams, so a v5e program copies no
  stacked factor into another layout. Batched inside the per-example pass,
  each product read a copy transposed examples outermost; cut into
  symmetric blocks, one copied block-major (without both, a two-layer
  T5-Small step takes 16% fewer v5e cycles). The copies left keep their
  layout: the loops' results, copied out of the loops' buffers."""
  from dpjax.models import t5
  from dpjax.privacy import ghost

  layers, examples = 2, 3
  cfg = t5.T5Config(vocab_size=256, d_model=128, d_kv=32, d_ff=256,
                    num_heads=4, num_encoder_layers=layers,
                    num_decoder_layers=layers, dropout_rate=0.0,
                    scan_layers=True, dtype="bfloat16")
  device = shared_target("tpu:v5e:2x2").devices[0]
  on_device = lambda shape, dtype: jax.ShapeDtypeStruct(
      shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
  params = jax.tree.map(lambda p: on_device(p.shape, p.dtype),
                        t5.abstract_params(cfg, input_length=64,
                                           target_length=16)[0])
  batch = {name: on_device((examples, 64 if name.startswith("encoder")
                            else 16), np.float32 if name.endswith("weights")
                           else np.int32)
           for name in ("encoder_input_tokens", "decoder_input_tokens",
                        "decoder_target_tokens", "decoder_loss_weights")}
  clipped = ghost.ghost_clipped_grad(t5.make_example_loss(cfg), clip_norm=1.0)
  with targets.without_persistent_cache():
    text = jax.jit(clipped).lower(
        params, batch, on_device((examples,), np.float32)).compile().as_text()
  stacked = re.findall(
      rf"= (?:bf16|f32)\[((?:{layers},{examples}|{examples},{layers}),"
      r"[\d,]+)\]\{([\d,]+)[:}]\S* copy\(", text)
  assert stacked  # the loops' results: a copy in place
  for dims, layout in stacked:
    rank = len(dims.split(","))
    assert dims.startswith(f"{layers},{examples},"), dims
    assert layout == ",".join(map(str, range(rank - 1, -1, -1))), (
        dims, layout)
