"""A plan before the run: `python -m dpjax.train ... --dry_run`.

`dry_run` builds everything the run would use (`trainer.build`: data
loaded and counted, σ calibrated, budget checked, microbatch and remat
sized, steps placed on the mesh) and writes nothing: no MODEL_DIR, no
secret file, no sizing record. It compiles the DP step for abstract shapes
(`dpjax.training.step_cost`: nothing allocated, so the paper's T5-XL is checked on a
CPU) and prints one JSON line:

  n, q, steps, dp_steps, sigma, epsilon (planned), target_epsilon, delta,
  accountant, sampling, clipping_method (what 'auto' resolves to),
  ghost_summation (with ghost clipping: how it forms the clipped sum,
  'book_keeping' or 'second_pass', 'auto' resolved; else null), remat,
  microbatch_size, accumulation_calls (microbatches per step), mesh, rules,
  compute_dtype, params, peak_bytes_per_device (compiled), state_bytes,
  device_memory_bytes, fits, flops_per_step and bytes_accessed_per_step
  (XLA cost analysis, per device), backend, device_kind, devices,
  scan_layers (whether the model's layers are a loop: XLA's analysis
  counts a loop's body once, so a microbatch's FLOPs, bytes and time come
  from the same program with the loop unrolled at one and two layers per
  stack, `step_cost.per_layer_extrapolation`);

with a compile target (`--target=tpu:v4:2x2x4`, `dpjax.training.targets`) all of it
for the target's devices and memory, compiled by its compiler on this host,
plus target, chips, step_time_estimate_s (the TPU compiler's estimate of
k x accumulate + apply, `optimal_seconds`: a matmul at its FLOPs over the
chip's bf16 rate, whatever its precision), step_cycles_estimate (the same
programs' per-op cycles by the TPU code generator, which count a float32
product's bf16 passes; `step_cost.cost_analysis`; a scanned model's from
its loop program, each iteration counted), projected_wall_s (the
time estimate times the steps left) and mfu (the step's FLOPs per device
over that time at the chip's peak); a
run that does not fit the target's memory is then refused (exit 2, the
figures in one line), so that the dry run is a launch's preflight;

and with `steps=K` (`--dry_run_steps=K`) it also initialises the params,
runs K real steps (their releases go nowhere: nothing is saved) and adds
step_time_s (the median after the first, which compiles) and
projected_wall_s (that times the steps left to run).

On a CPU, XLA's default scheduler favours concurrency: it keeps every
layer's temporaries (and the noise of every parameter) alive at once, so
its compiled peak says little about an accelerator's memory-aware schedule.
`use_memory_scheduler` (called by `python -m dpjax.train --dry_run` before
the backend starts) selects XLA's memory-minimising CPU scheduler instead;
the line records the XLA_FLAGS it was compiled with.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import jax

from dpjax.training import (distributed, partitioning, reporting, run_config, sizing, step_cost, targets, trainer)
from dpjax import errors
from dpjax.models import common

RunConfig = run_config.RunConfig
MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def use_memory_scheduler() -> None:
  """Adds `MEMORY_SCHEDULER_FLAG` to XLA_FLAGS (it affects CPU compiles
  only); effective if the backend has not started yet."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {MEMORY_SCHEDULER_FLAG}".strip()


def dry_run(config: RunConfig, steps: int = 0,
            target: str | None = None) -> dict:
  """The run's plan and compiled cost as one JSON line (printed and
  returned); with `steps` > 0, also K timed steps; with `target` (a
  `dpjax.training.targets` spec), for that TPU slice. Writes nothing."""
  if target and steps:
    raise errors.UsageError(
        f"--dry_run_steps runs steps on this host; --target {target} "
        "compiles for devices that are not here: use one or the other")
  compile_target = targets.resolve(target) if target else None
  distributed.initialize()
  with targets.compiling_for(compile_target):
    return _dry_run(config, steps, compile_target)


def _dry_run(config: RunConfig, steps: int,
             compile_target: targets.Target | None) -> dict:
  built = trainer.build(config, dry_run=True, target=compile_target)
  plan, choice, mesh = built.plan, built.sizing, built.mesh
  m, k = choice.microbatch_size, choice.accumulation_steps
  batch_sh = partitioning.batch_sharding(mesh, 3, batch_dim=1,
                                         rules=built.rules)
  mask_sh = partitioning.batch_sharding(mesh, 2, batch_dim=1,
                                        rules=built.rules)
  shardings = dict(batch_sharding=batch_sh, mask_sharding=mask_sh)
  layers = common.scanned_layers(config.model_config)
  # A scanned model's own analysis counts its layer loop once.
  per_microbatch = (step_cost.scanned_accumulate_cost(
      lambda counts: built.place_model(
          common.loop_unrolled(built.model.config, counts)),
      layers, built.batch_rows, m=m,
      multiple=partitioning.data_parallel_size(mesh, built.rules),
      **shardings) if layers else None)
  try:
    cost = step_cost.step_cost(built.placed, built.batch_rows, m=m, k=k,
                               with_flops=not layers or per_microbatch is not None,
                               accumulate_cost=per_microbatch, **shardings)
  except jax.errors.JaxRuntimeError as e:
    refused = step_cost.refusal(e)
    if refused is None:
      raise
    raise errors.UsageError(
        f"the run does not fit {compile_target.spec if compile_target else 'this device'}: "
        f"its compiler refused microbatch {m} ({sizing.model_remat(built.model.config)} "
        "remat), " + (f"needing {refused.temporaries / 2**30:.2f} GiB of "
                      "temporaries beyond the state" if refused.temporaries
                      else refused.message)) from None
  memory, source = sizing.device_memory(config.device_memory,
                                        compile_target)
  limit = int(memory * config.memory_headroom)
  start = built.resume.step if built.resume else 0
  abstract = built.placed.abstract_state.params
  device = mesh.devices.flat[0]
  method, summation = trainer.clipping_of(
      built.model, built.batch_rows, config.clipping_method,
      choice.ghost_summation or config.ghost_summation)
  record = {
      "n": plan.privacy.dataset_size,
      "q": plan.privacy.batch_size / plan.privacy.dataset_size,
      "steps": plan.steps, "dp_steps": plan.privacy.dp_steps,
      "start_step": start, "sigma": plan.noise_multiplier,
      "epsilon": plan.planned_epsilon,
      "target_epsilon": plan.target_epsilon, "delta": plan.delta,
      "accountant": plan.ledger.accountant,
      "sampling": plan.sampler.describe()["method"],
      "privacy_unit": plan.mechanism.unit,
      "mechanism": plan.ledger.mechanism,
      "clipping_method": method,
      "ghost_summation": summation,
      "remat": sizing.model_remat(built.model.config),
      "scan_layers": bool(layers),
      "microbatch_size": m, "accumulation_calls": k,
      "auto_sizing": choice.peak_bytes is not None,
      "mesh": dict(mesh.shape), "rules": [list(r) for r in built.rules],
      "compute_dtype": next(
          (str(d) for d in sizing.config_values(built.model.config, "dtype")),
          None),
      "params": int(sum(x.size for x in jax.tree.leaves(abstract))),
      "peak_bytes_per_device": cost.peak_bytes,
      "state_bytes_per_device": cost.state_bytes,
      "device_memory_bytes": limit, "device_memory_source": source,
      "fits": cost.peak_bytes <= limit,
      "flops_per_step": cost.flops,
      "bytes_accessed_per_step": cost.bytes_accessed,
      # A scanned model's cost programs refused at m: costed at this
      # microbatch and scaled (`step_cost.scanned_accumulate_cost`).
      "cost_scaled_from_microbatch": (per_microbatch or {}).get(
          "scaled_from_microbatch"),
      # Which layer's addition each stack's cost was extrapolated from
      # (`step_cost.per_layer_extrapolation`).
      "cost_per_layer_from": (per_microbatch or {}).get("per_layer_from"),
      "backend": device.platform, "device_kind": device.device_kind,
      "devices": mesh.devices.size,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  if compile_target:
    record.update(_target_estimates(compile_target, cost,
                                    built.plan.steps - start))
  if steps:
    record.update(_timed_steps(built, steps, start))
  if built.mngr is not None:
    built.mngr.close()
  if built.init_run:
    built.init_run.manager.close()
  if distributed.is_primary():
    print(json.dumps(record), flush=True)
  if compile_target and not record["fits"]:  # a preflight's answer: no
    raise errors.UsageError(
        f"the run does not fit {compile_target.spec}: peak "
        f"{cost.peak_bytes / 2**30:.2f} GiB per device at microbatch {m} "
        f"({record['remat']} remat), {limit / 2**30:.2f} GiB usable "
        f"({source} x train.memory_headroom {config.memory_headroom})")
  return record


def _target_estimates(target: targets.Target, cost: step_cost.StepCost,
                      steps_left: int) -> dict:
  """What the target's compiler says of the step's time (None where it
  gives no estimate), the run's projected wall time and the MFU at it."""
  seconds = cost.seconds
  return {"target": target.spec, "chips": target.chips,
          "peak_flops_per_device": target.peak_flops,
          "step_time_estimate_s": seconds,
          "step_cycles_estimate": cost.cycles,
          "projected_wall_s": None if seconds is None else seconds * steps_left,
          "mfu": (None if not seconds else
                  cost.flops / (seconds * target.peak_flops))}


def _timed_steps(built: trainer.Built, steps: int, start: int) -> dict:
  """K real steps from freshly initialised params (the first compiles):
  the median time of the rest and the run's projected wall time."""
  placed = built.placed
  params = jax.jit(
      lambda: built.model.init_params(jax.random.PRNGKey(0))[0],
      out_shardings=placed.state_shardings.params)()
  state = placed.init(params)
  step_fn = trainer.step_function(
      built.plan, placed, built.splits, mesh=built.mesh, rules=built.rules,
      m=built.sizing.microbatch_size, k=built.sizing.accumulation_steps,
      noise_secret=distributed.global_array(
          built.run_secret.noise_key(),
          partitioning.replicated(built.mesh)))
  times = []
  for t in range(start, min(start + steps, built.plan.steps)):
    began = time.perf_counter()
    state, _ = step_fn(state, t)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - began)
  step_s = statistics.median(times[1:] or times)
  return {"timed_steps": len(times), "first_step_s": times[0],
          "step_time_s": step_s,
          "projected_wall_s": step_s * (built.plan.steps - start)}
