"""`python -m dpjax.bench`: one training step, timed, as one JSON line.

  python -m dpjax.bench --model=gpt2_small --seq=256 --batch=32 --mode=vmap

Models are the gin files of gin/models (gpt2_*, t5_*, t5_1_1_*), fed random
tokens: `--seq` tokens per example for GPT-2, `--seq` inputs and `--seq`
targets for T5 (or --input_length / --target_length). Dropout is off.
Modes:

  nodp         gradient of the mean loss and optax Adam: the non-private
               baseline;
  vmap, ghost  the trainer's DP step: `step.make_accumulate` over
               [K, m] microbatches, clipping by
               `clipping_method.make_clipped_grad` with that method (ghost:
               `ghost.ghost_clipped_grad`, the same callable), then
               `make_apply` with DP-Adam (noise on);
  jax_privacy  `jax_privacy.clipping.clipped_grad` on the same model and the
               same DP-Adam, when jax-privacy is installed (never a
               dependency of dpjax).

A step is one logical batch of `--batch` examples in microbatches of
`--microbatch`; the batch already sits on the devices, so host input is not
timed. Reported: the median step time over `--steps` steps after `--warmup`
untimed ones, tokens/s, peak device memory (the allocator's peak where the
backend has one, else XLA's memory analysis of the compiled step; the
compiled step's memory analysis is in the line too, to set beside a
`--target` compile of the same step), and
MFU = 6 N tokens/s / (devices x peak dense bf16 FLOP/s per device), with N
the parameter count and tokens all input and target tokens (the usual
estimate: attention is ignored and, for T5, every parameter is counted for
every token); null where the device's peak is not in `PEAK_BF16_FLOPS`.
`--memory_only` compiles the step for abstract inputs and reports XLA's
memory analysis without allocating or running anything, and
`residual_bytes`: what the backward pass of one microbatch's loss keeps from
its forward pass (JAX's residuals, params and their compute-dtype copies
included), whatever the mode: the compiler-independent view of
`--remat=layer` (every transformer layer rematerialised, the config's
`remat`; ghost clipping then sums by a second backward pass unless
`--ghost_summation=book_keeping`). XLA's default
CPU scheduler favours concurrency and runs the recomputation early, so its
memory analysis shows little of the saving; run with
`XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false` for the
memory-minimising one (every line records the XLA_FLAGS it ran with).

Every line also carries XLA's cost analysis of one logical step as it runs:
`flops` and `bytes_accessed` = K x (accumulate of one microbatch) + apply,
each part compiled alone for abstract inputs (XLA counts a loop's body once,
so the whole step's own analysis would count one microbatch); `cost_parts`
holds the parts, with the `while_loops` each kept (a part with loops left is
undercounted: on CPU, the noise's threefry keeps a rolled loop in
`apply`) and, where the whole step was compiled, its own analysis
(`whole_step`). Bytes accessed are the compiled backend's, after its fusion.
With `--scan_layers` (T5: its layers a loop over stacked params, one layer
compiled per stack) accumulate's own analysis would count the loop's body
once: its part comes from the same program with the loop unrolled at one
and two layers per stack instead (`step_cost.per_layer_extrapolation`).
`--compare_nodp` also compiles the nodp step for the same model and shape
and adds `nodp_flops`, `nodp_bytes_accessed` (`nodp_cost_parts`),
`flops_vs_nodp` and `bytes_vs_nodp`. `--cost_only` compiles the parts alone (no memory
analysis, nothing allocated): the DP overhead of any model on a CPU.
`--no_cost` skips it (two compiles fewer: a T5-XL compile takes minutes on
a CPU). `--ghost_norm` and `--ghost_summation` pick ghost clipping's per-site norm
path and summation (`ghost.ghost_clipped_grad`'s `norm`, `summation`).

`--target=tpu:v5e:2x2` (or `gpu:h100:1x8`, `dpjax.training.targets`) compiles the
step for that target's devices on this host, as `--memory_only` does: its
memory analysis, `residual_bytes` and cost (with `--compare_nodp`, the DP
overhead by the target's compiler), and on a TPU `step_time_estimate_s`,
the compiler's estimate of the logical step; nothing runs. The line's
`device_kind`, `platform` and `num_devices` are the target's.

Failures that are the setup's, not a bug (an unknown model, a mode that is
not available, out of device memory), are one JSON line with an "error"
field and exit status 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import configurables, errors, gin_cli
from dpjax.training import partitioning, step as step_lib, step_cost, targets
from dpjax.training.state import TrainState, init_state
from dpjax.privacy.mechanisms import multi_loss
from dpjax.models import common, lora, t5
from dpjax.models import trainable as trainable_lib
from dpjax.privacy import clipping, clipping_method, ghost, optimizers, secret

MODES = ("nodp", "vmap", "ghost", "jax_privacy")
# How a row's error begins where the target's compiler refused the step for
# want of device memory (`step_cost.refusal`), as against any other failure.
OUT_OF_MEMORY = "out of device memory"
MODEL_DIR = os.path.join(gin_cli.REPO_GIN_DIR, "models")
CONFIGS = {"gpt2": configurables.GPT2Config, "t5": configurables.T5Config}

# Peak dense bf16 FLOP/s of one device, by a substring of `device_kind`; the
# first match wins (so the H100 PCIe comes before other H100s).
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
)


class Unavailable(Exception):
  """This benchmark cannot run here; reported as a JSON "error" line."""


def peak_flops(device_kind: str) -> float | None:
  """The peak bf16 FLOP/s of `device_kind` (`PEAK_BF16_FLOPS`), or None."""
  return next((f for k, f in PEAK_BF16_FLOPS if k in device_kind), None)


def mfu(num_params: int, tokens_per_second: float,
        peak_per_device: float | None, num_devices: int) -> float | None:
  """Model FLOPs utilisation: 6 N tokens/s over the devices' peak."""
  if peak_per_device is None:
    return None
  return 6 * num_params * tokens_per_second / (peak_per_device * num_devices)


def scannable(name: str) -> bool:
  """Whether model `name` has a scanned form: its config has `scan_layers`
  (T5's has, GPT-2's not)."""
  config = CONFIGS.get(name.split("_")[0])
  return config is not None and "scan_layers" in {
      f.name for f in dataclasses.fields(config)}


def model_config(name: str, *, dtype: str, vocab_size: int | None = None,
                 num_layers: int | None = None, remat: str = "none",
                 lora_rank: int = 0, scan_layers: bool = False):
  """The config of gin/models/{name}.gin with compute `dtype`, dropout off,
  rematerialisation `remat`, with `num_layers` that many layers (T5: in the
  encoder and in the decoder), with `lora_rank`, LoRA adapters of that
  rank on the attention projections (only they train) and, with
  `scan_layers` (T5), its layers a loop (`T5Config.scan_layers`)."""
  path = os.path.join(MODEL_DIR, f"{name}.gin")
  family = name.split("_")[0]
  if family not in CONFIGS or not os.path.isfile(path):
    known = sorted(f[:-4] for f in os.listdir(MODEL_DIR)
                   if f.split("_")[0] in CONFIGS)
    raise Unavailable(f"unknown model {name!r}; choose from {known}")
  gin.clear_config()
  try:
    gin.parse_config_file(path)
    config = CONFIGS[family]()
  finally:
    gin.clear_config()
  overrides = {"vocab_size": vocab_size} if vocab_size else {}
  if num_layers:
    overrides.update(
        {"num_encoder_layers": num_layers, "num_decoder_layers": num_layers}
        if family == "t5" else {"num_layers": num_layers})
  if lora_rank:
    overrides["lora"] = lora.LoRAConfig(rank=lora_rank,
                                        alpha=2.0 * lora_rank)
  if scan_layers:
    if not scannable(name):
      raise Unavailable(f"--scan_layers: {name} has no scanned form (T5 has)")
    overrides["scan_layers"] = True
  return dataclasses.replace(config, dtype=dtype, dropout_rate=0.0,
                             remat=remat, **overrides)


def synthetic_batch(converter: str, vocab_size: int, lengths: dict,
                    shape: tuple[int, int], seed: int = 0) -> dict:
  """Random tokens `[K, m, length]` in the layout of the model's features."""
  rng = np.random.default_rng(seed)
  tokens = lambda n: rng.integers(1, vocab_size, (*shape, n), dtype=np.int32)
  if converter == "encoder_decoder":
    targets = tokens(lengths["targets"])
    decoder_inputs = np.concatenate(
        [np.zeros((*shape, 1), np.int32), targets[..., :-1]], axis=-1)
    return {"encoder_input_tokens": tokens(lengths["inputs"]),
            "decoder_input_tokens": decoder_inputs,
            "decoder_target_tokens": targets,
            "decoder_loss_weights": np.ones(targets.shape, np.float32)}
  ids = tokens(lengths["targets"])
  return {"tokens": ids, "loss_weights": np.ones(ids.shape, np.float32)}


@dataclasses.dataclass(frozen=True)
class BenchStep:
  """One logical step in two parts, as the trainer runs it: `accumulate(params,
  batch[K,m,...], mask[K,m], step) -> (sums, metrics)` scans the K
  microbatches, `apply(state, sums) -> state` updates once."""
  tx: optax.GradientTransformation | optimizers.DPOptimizer
  accumulate: Callable
  apply: Callable

  def __call__(self, state, batch, mask):
    sums, metrics = self.accumulate(state.params, batch, mask, state.step)
    return self.apply(state, sums), metrics


def build_step(mode: str, model: trainable_lib.Trainable, *, batch_size: int,
               microbatch_size: int, clip_norm: float,
               noise_multiplier: float, learning_rate: float, seed: int,
               ghost_norm: str = "auto", ghost_summation: str = "auto"
               ) -> BenchStep:
  """The step of `mode`; `step(state, batch[K,m,...], mask[K,m]) -> (state,
  metrics)`, one logical batch, to be jitted. `ghost_norm` and
  `ghost_summation`: `ghost.ghost_clipped_grad`'s `norm` and `summation`.
  A model with a trainable mask (LoRA) differentiates, clips, noises and
  keeps optimizer state for its trained leaves only, as the trainer does."""
  trainable = multi_loss.trainable_mask(model)
  adam = (optax.adam(learning_rate) if trainable is None else
          optimizers.freeze(optax.adam(learning_rate), trainable))
  if mode == "nodp":
    tx = adam

    def nodp_accumulate(params, batch, mask, step):
      del mask, step  # every synthetic example is real

      def add_grad(grads, microbatch):
        loss = lambda p, b: model.batch_loss(p, b).sum()
        if trainable is None:
          value, g = jax.value_and_grad(loss)(params, microbatch)
        else:  # w.r.t. the trained leaves only (the frozen ones: zeros)
          g, value = clipping.trained_only(
              lambda f: lambda p, b, _: jax.value_and_grad(f)(p, b)[::-1],
              loss, trainable, 1.0)(params, microbatch, None)
        return jax.tree.map(jnp.add, grads, g), value

      grads, losses = jax.lax.scan(
          add_grad, step_lib.zeros_like_f32(params), batch)
      return grads, {"loss_sum": losses.sum()}

    def nodp_apply(state, grads):
      grads = jax.tree.map(lambda g: g / batch_size, grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      return TrainState(
          state.step + 1, optax.apply_updates(state.params, updates),
          opt_state, state.noise_count)

    return BenchStep(tx, nodp_accumulate, nodp_apply)

  dp_adam = lambda sensitivity: optimizers.dp_optimizer(
      adam, noise_multipliers={multi_loss.LOSS: noise_multiplier},
      sensitivities={multi_loss.LOSS: sensitivity}, normalizer=batch_size,
      trainable=trainable)
  # A benchmark releases nothing: its noise key may be a compiled constant,
  # pinned to `seed` so that the same step is the same program (jax's
  # persistent compilation cache then compiles it once).
  noise_secret = jnp.asarray(secret.RunSecret.pinned(seed).noise_key())
  if mode == "jax_privacy":
    try:
      from jax_privacy import clipping as jp_clipping
    except ImportError as e:
      raise Unavailable(f"jax_privacy mode needs jax-privacy installed ({e})")
    if trainable is not None:
      raise Unavailable("jax_privacy mode has no trainable mask (LoRA)")
    # One microbatch: no loop over microbatches (a compiler's cost analysis
    # counts a loop's body once, and jax-privacy bounds its loop at run time).
    clipped = jp_clipping.clipped_grad(
        model.example_loss, l2_clip_norm=clip_norm, batch_argnums=1,
        keep_batch_dim=False, dtype=jnp.float32,
        microbatch_size=None if microbatch_size == batch_size
        else microbatch_size)
    tx = dp_adam(clip_norm)

    def jax_privacy_accumulate(params, batch, mask, step):
      del step
      flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)
      grads = clipped(params, flat, is_padding_example=mask.reshape(-1) == 0)
      return {multi_loss.LOSS: grads}, {}
    accumulate = jax_privacy_accumulate
  else:
    if mode == "ghost":
      make = lambda loss: ghost.ghost_clipped_grad(
          loss, clip_norm=clip_norm, norm=ghost_norm,
          summation=ghost_summation)
      clipped = (make(model.example_loss) if trainable is None else
                 clipping.trained_only(make, model.example_loss, trainable,
                                       clip_norm))
    else:
      clipped = clipping_method.make_clipped_grad(
          model.example_loss, clip_norm=clip_norm, method=mode,
          trainable=trainable)
    tx = dp_adam(clipped.sensitivity)
    dp_accumulate = step_lib.flat_metrics(step_lib.make_accumulate(
        clipped, seed=seed, dropout=False))
    accumulate = lambda params, batch, mask, step: dp_accumulate(
        params, {multi_loss.LOSS: step_lib.zeros_like_f32(params)}, batch,
        mask, step, 0)
  dp_apply = step_lib.make_apply(tx)
  return BenchStep(tx, accumulate,
                   lambda state, sums: dp_apply(state, sums, noise_secret))


def _parse_mesh(text: str) -> dict[str, int]:
  """'data:2,fsdp:4' -> {'data': 2, 'fsdp': 4}."""
  try:
    return {k: int(v) for k, v in (part.split(":") for part in text.split(","))}
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected AXIS:SIZE[,AXIS:SIZE...], e.g. data:2,fsdp:4; got {text!r}")


def abstract_state(tx, abstract_params, axes, mesh, rules):
  """(state shardings, the abstract train state carrying them)."""
  state_sh = partitioning.state_shardings(mesh, tx, abstract_params, axes,
                                          rules)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(lambda p: init_state(p, tx), abstract_params),
      state_sh)
  return state_sh, state


def logical_step_cost(step: BenchStep, state, batch, mask,
                      accumulate_cost: dict | None = None) -> dict:
  """XLA's cost of one logical step on abstract `state`, `batch[K,m,...]`,
  `mask[K,m]`, as it is executed (`step_cost.combine`); `cost_parts`
  holds the parts. `accumulate_cost`: one microbatch's figures from
  elsewhere (a scanned model's, `step_cost.per_layer_extrapolation`; its
  cycles then the loop program's own, `step_cost.with_loop_cycles`)."""
  k, mesh = mask.shape[0], mask.sharding.mesh
  accumulate, one = _one_microbatch_accumulate(step, state, batch, mask)
  compiled = accumulate.compile()
  sums = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(step.accumulate, state.params, *one, state.step)[0],
      compiled.output_shardings[0])
  apply = jax.jit(step.apply, donate_argnums=0).lower(state, sums)
  total = step_cost.combine(
      step_cost.with_loop_cycles(accumulate_cost, compiled) if accumulate_cost
      else step_cost.loop_free_cost(accumulate, mesh, compiled),
      step_cost.loop_free_cost(apply, mesh, apply.compile()), k)
  return {"flops": total["flops"], "bytes_accessed": total["bytes_accessed"],
          "seconds": total["seconds"], "cycles": total["cycles"],
          "cost_parts": {"sum": "microbatches x accumulate + apply",
                         "microbatches": k, **total["parts"]}}


def _one_microbatch_accumulate(step: BenchStep, state, batch, mask):
  """(`step.accumulate` lowered for one microbatch of `batch`, that
  microbatch and its mask as abstract shapes)."""
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (1, *x.shape[1:]), x.dtype, sharding=x.sharding), (batch, mask))
  return jax.jit(step.accumulate).lower(state.params, *one, state.step), one


def residual_bytes(loss: Callable, params, microbatch) -> int:
  """Bytes of the residuals `jax.vjp(loss)` keeps (abstract: runs nothing)."""
  vjp_fn = jax.eval_shape(lambda p, b: jax.vjp(lambda q: loss(q, b), p)[1],
                          params, microbatch)
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(vjp_fn))


def run(args: argparse.Namespace) -> dict:
  """Builds, compiles and (unless --memory_only) times the step."""
  config = model_config(args.model, dtype=args.dtype, vocab_size=args.vocab,
                        num_layers=args.layers, remat=args.remat,
                        lora_rank=args.lora_rank, scan_layers=args.scan_layers)
  if isinstance(config, t5.T5Config):
    lengths = {"inputs": args.input_length or args.seq,
               "targets": args.target_length or args.seq}
  else:
    lengths = {"inputs": 0, "targets": args.seq}
  model = trainable_lib.trainable(config, lengths)
  m = args.microbatch or args.batch
  if args.batch % m:
    raise Unavailable(f"--batch={args.batch} is not a multiple of "
                      f"--microbatch={m}")
  shape = (args.batch // m, m)

  try:
    mesh = partitioning.make_mesh(
        args.mesh, devices=args.target.devices if args.target else None)
  except ValueError as e:
    raise Unavailable(str(e))
  rules = partitioning.logical_axis_rules(args.rules)
  if m % partitioning.data_parallel_size(mesh, rules):
    raise Unavailable(f"microbatch {m} does not split over the "
                      f"{partitioning.data_parallel_size(mesh, rules)} "
                      "data-parallel devices")
  def build(mode, model=model):
    step = build_step(
        mode, model, batch_size=args.batch, microbatch_size=m,
        clip_norm=args.clip_norm, noise_multiplier=args.noise_multiplier,
        learning_rate=args.learning_rate, seed=args.seed,
        ghost_norm=args.ghost_norm, ghost_summation=args.ghost_summation)
    params, axes = model.abstract_params()
    update = partitioning.update_shardings(mesh, axes, rules, params)
    layout = update if mode == "nodp" else {multi_loss.LOSS: update}

    def accumulate(*args):  # the sums laid out for the update, as trained
      sums, metrics = step.accumulate(*args)
      return jax.lax.with_sharding_constraint(sums, layout), metrics
    return dataclasses.replace(step, accumulate=partitioning.batch_laid_out(
        accumulate, mesh, rules))
  step = build(args.mode)
  tx = step.tx
  abstract_params, axes = model.abstract_params()
  state_sh, state_abstract = abstract_state(tx, abstract_params, axes, mesh,
                                            rules)
  batch_sh = partitioning.batch_sharding(mesh, 3, batch_dim=1, rules=rules)
  mask_sh = partitioning.batch_sharding(mesh, 2, batch_dim=1, rules=rules)
  jitted = jax.jit(step, in_shardings=(state_sh, batch_sh, mask_sh),
                   out_shardings=(state_sh, partitioning.replicated(mesh)),
                   donate_argnums=0)

  batch = synthetic_batch(model.converter, config.vocab_size, lengths, shape,
                          args.seed)
  mask = np.ones(shape, np.float32)
  batch_abstract, mask_abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      (batch, mask), (jax.tree.map(lambda _: batch_sh, batch), mask_sh))
  start = time.perf_counter()
  if not args.cost_only:
    compiled = jitted.lower(state_abstract, batch_abstract,
                            mask_abstract).compile()
  compile_s = time.perf_counter() - start
  layers = common.scanned_layers(config)

  def step_cost_of(mode: str, step: BenchStep, state) -> dict:
    """`logical_step_cost`; a scanned model's microbatch from its loop
    unrolled at one and two layers per stack (XLA counts a loop's body
    once)."""
    def unrolled_cost(counts):
      other = trainable_lib.trainable(common.loop_unrolled(config, counts),
                                      lengths)
      other_step = build(mode, other)
      params, axes = other.abstract_params()
      other_state = abstract_state(other_step.tx, params, axes, mesh, rules)[1]
      return step_cost.loop_free_cost(_one_microbatch_accumulate(
          other_step, other_state, batch_abstract, mask_abstract)[0], mesh)

    return logical_step_cost(
        step, state, batch_abstract, mask_abstract,
        accumulate_cost=(step_cost.per_layer_extrapolation(unrolled_cost, layers)
                         if layers else None))

  start = time.perf_counter()
  if args.no_cost:  # a model whose every compile takes minutes (T5-XL, CPU)
    cost = {"flops": None, "bytes_accessed": None, "cost_parts": None}
  else:
    cost = step_cost_of(args.mode, step, state_abstract)
  if not args.cost_only and not args.no_cost:
    cost["cost_parts"]["whole_step"] = step_cost.cost_analysis(compiled)
  if args.compare_nodp and not args.no_cost:
    if args.mode == "nodp":
      nodp = cost
    else:
      nodp_step = build("nodp")
      nodp = step_cost_of("nodp", nodp_step, abstract_state(
          nodp_step.tx, abstract_params, axes, mesh, rules)[1])
    cost.update(nodp_flops=nodp["flops"],
                nodp_bytes_accessed=nodp["bytes_accessed"],
                nodp_cost_parts=nodp["cost_parts"],
                flops_vs_nodp=cost["flops"] / nodp["flops"],
                bytes_vs_nodp=cost["bytes_accessed"] / nodp["bytes_accessed"])
  cost["cost_compile_s"] = round(time.perf_counter() - start, 3)

  num_params = sum(x.size for x in jax.tree.leaves(abstract_params))
  trained = multi_loss.trainable_mask(model)
  trained_params = num_params if trained is None else sum(
      x.size for x, t in zip(jax.tree.leaves(abstract_params),
                             jax.tree.leaves(trained)) if t)
  tokens_per_step = args.batch * sum(lengths.values())
  device = jax.devices()[0]
  result = dict(
      model=args.model, mode=args.mode, dtype=args.dtype, remat=args.remat,
      scan_layers=args.scan_layers,
      target=args.target.spec if args.target else None,
      lora_rank=args.lora_rank,
      batch=args.batch, microbatch=m, lengths=lengths,
      tokens_per_step=tokens_per_step,
      params=num_params, trained_params=trained_params,
      mesh=dict(mesh.shape), rules=args.rules,
      compile_s=None if args.cost_only else round(compile_s, 3),
      **cost)
  if args.mode == "ghost":
    result.update(ghost_norm=args.ghost_norm,
                  ghost_summation=args.ghost_summation)
  if args.cost_only:
    return result
  if args.memory_only or args.target:
    result["memory_analysis"] = step_cost.memory_analysis(compiled)
    if args.target:
      result["step_time_estimate_s"] = cost.get("seconds")
    microbatch = jax.eval_shape(lambda: jax.tree.map(lambda x: x[0], batch))
    result["residual_bytes"] = residual_bytes(
        lambda p, b: model.batch_loss(p, b).sum(), abstract_params, microbatch)
    return result

  params, _ = model.init_params(jax.random.PRNGKey(args.seed))
  state = jax.jit(lambda p: init_state(p, tx),
                  out_shardings=state_sh)(params)
  del params
  batch = jax.device_put(batch, batch_sh)
  mask = jax.device_put(mask, mask_sh)
  times = []
  for i in range(args.warmup + args.steps):
    start = time.perf_counter()
    state, _ = compiled(state, batch, mask)
    jax.block_until_ready(state)
    if i >= args.warmup:
      times.append(time.perf_counter() - start)

  step_s = statistics.median(times)
  tokens_per_s = tokens_per_step / step_s
  analysis = step_cost.memory_analysis(compiled)
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  if all("peak_bytes_in_use" in s for s in stats):
    peak_memory = max(s["peak_bytes_in_use"] for s in stats)
    memory_source = "memory_stats"
  else:
    peak_memory = analysis["peak_estimate_bytes"]
    memory_source = "memory_analysis"
  peak = peak_flops(device.device_kind)
  result.update(
      steps=args.steps, warmup=args.warmup, step_time_s=round(step_s, 6),
      step_time_min_s=round(min(times), 6),
      step_time_max_s=round(max(times), 6),
      tokens_per_s=round(tokens_per_s, 1),
      examples_per_s=round(args.batch / step_s, 2),
      peak_memory_bytes=int(peak_memory), peak_memory_source=memory_source,
      memory_analysis=analysis,
      mfu=mfu(num_params, tokens_per_s, peak, jax.device_count()),
      peak_flops_per_device=peak)
  return result


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parses and checks the flags of `python -m dpjax.bench` (one step)."""
  p = argparse.ArgumentParser(
      prog="python -m dpjax.bench",
      description="Time one training step on synthetic tokens; one JSON line.")
  p.add_argument("--model", required=True,
                 help="a gin/models name: gpt2_small, t5_xl, t5_1_1_base, ...")
  p.add_argument("--mode", choices=MODES, default="vmap")
  p.add_argument("--seq", type=int, default=256,
                 help="tokens per example (T5: inputs and targets each)")
  p.add_argument("--input_length", type=int, help="T5 inputs (default --seq)")
  p.add_argument("--target_length", type=int,
                 help="T5 targets (default --seq)")
  p.add_argument("--batch", type=int, default=32,
                 help="examples per step (one logical batch)")
  p.add_argument("--microbatch", type=int,
                 help="examples per microbatch (default: --batch)")
  p.add_argument("--remat", choices=t5.REMATS, default="none",
                 help="'layer': recompute each layer's activations in the "
                 "backward pass")
  p.add_argument("--dtype", choices=("bfloat16", "float32"),
                 default="bfloat16", help="compute dtype; params are float32")
  p.add_argument("--steps", type=int, default=10, help="timed steps")
  p.add_argument("--warmup", type=int, default=3,
                 help="untimed steps first")
  p.add_argument("--mesh", type=_parse_mesh,
                 help="e.g. data:2,fsdp:4 (default: all devices on 'data')")
  p.add_argument("--rules", choices=sorted(partitioning.RULE_SETS),
                 default="data_parallel", help="logical-axis rule set")
  p.add_argument("--vocab", type=int,
                 help="override the vocabulary size (tiny gin files leave "
                 "it to the task)")
  p.add_argument("--scan_layers", action="store_true",
                 help="T5: the layers a loop over stacked params "
                 "(T5Config.scan_layers); one layer compiled per stack")
  p.add_argument("--layers", type=int,
                 help="override the number of layers (T5: encoder and "
                 "decoder each)")
  p.add_argument("--lora_rank", type=int, default=0,
                 help="LoRA adapters of this rank on q, k, v, o (alpha = 2 "
                      "rank); only they train (0: every weight)")
  p.add_argument("--clip_norm", type=float, default=1.0)
  p.add_argument("--noise_multiplier", type=float, default=1.0)
  p.add_argument("--learning_rate", type=float, default=1e-4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compare_nodp", action="store_true",
                 help="also compile the nodp step for the same model and "
                 "shape; add flops_vs_nodp and bytes_vs_nodp")
  p.add_argument("--ghost_norm", choices=("auto", "ghost", "direct"), default="auto",
                 help="ghost mode: per-site norm path (ghost_clipped_grad)")
  p.add_argument("--ghost_summation", choices=("auto", "book_keeping", "second_pass"),
                 default="auto",
                 help="ghost mode: book_keeping or second_pass sums")
  p.add_argument("--cost_only", action="store_true",
                 help="compile only the step's parts for XLA's cost "
                 "analysis; no memory analysis, allocates and runs nothing")
  p.add_argument("--memory_only", action="store_true",
                 help="compile for abstract inputs and report XLA's memory "
                 "analysis; allocates and runs nothing")
  p.add_argument("--no_cost", action="store_true",
                 help="skip the cost analysis (its two extra compiles): "
                 "flops and bytes_accessed are null")
  p.add_argument("--target", metavar="tpu:GEN:TOPOLOGY|gpu:NAME:HxG",
                 help="compile for a TPU slice or GPUs from this host "
                      "(dpjax.training.targets); memory and cost only, nothing runs")
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    p.error("--steps must be >= 1 and --warmup >= 0")
  if args.layers is not None and args.layers < 1:
    p.error("--layers must be >= 1")
  if args.no_cost and (args.cost_only or args.compare_nodp):
    p.error("--no_cost leaves nothing for --cost_only or --compare_nodp")
  return args


def machine_context(module: str, argv: Sequence[str],
                    target: targets.Target | None = None) -> dict:
  """What every benchmark line says about where and how it ran (for a
  compile target: the target's devices)."""
  devices = target.devices if target else jax.devices()
  return dict(device_kind=devices[0].device_kind,
              platform=devices[0].platform, num_devices=len(devices),
              jax_version=jax.__version__,
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              command=shlex.join(["python", "-m", module, *argv]))


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m dpjax.bench` (one step); returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  try:
    args.target = args.target and targets.resolve(args.target)
  except errors.UsageError as e:
    print(json.dumps({"error": str(e)}), flush=True)
    return 1
  context = machine_context("dpjax.bench", argv, args.target)
  try:
    with targets.compiling_for(args.target):
      result, status = run(args), 0
  except Unavailable as e:
    result, status = {"error": str(e)}, 1
  except jax.errors.JaxRuntimeError as e:
    if step_cost.refusal(e) is None:
      raise
    result, status = {"error": f"{OUT_OF_MEMORY}: {e}"}, 1
  print(json.dumps({**result, **context}), flush=True)
  return status

