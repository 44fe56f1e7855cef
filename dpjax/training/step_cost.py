"""What a compiled training step costs, read from XLA before it runs.

`step_cost` compiles a run's two DP halves (`dpjax.training.step.PlacedSteps`:
`accumulate` over one group of k microbatches of m, then `apply`) for
abstract shapes (`jax.ShapeDtypeStruct`s carrying their shardings), so
nothing is allocated: a T5-XL step on a laptop's CPU is measured as it
would be compiled there. It gives

* `peak_bytes`, per device: the larger of `accumulate`'s peak while the
  optimizer state it does not take stays resident, and `apply`'s peak (XLA's
  `memory_analysis`: arguments + outputs + temporaries - donated aliases);
* `flops` and `bytes_accessed` of one logical step, k x accumulate of one
  microbatch + apply (XLA's `cost_analysis`; XLA counts a loop body once,
  whatever its trip count, so the scan's body is costed alone and scaled,
  and the TPU compiler's windowed-einsum loops are compiled out of the
  programs costed: `loop_free_cost`), and on TPU the compiler's estimate of
  the step's time.

Limits: the figures are XLA's estimates for the backend compiled for (a
CPU's are not a GPU's), and they ignore the runtime's own reserve and
fragmentation; `dpjax.training.sizing` leaves headroom for that. A GPU compiled for
without a device reports no cost analysis: its optimized module's generic
HLO cost analysis stands in (`generic_cost_analysis`).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np

from dpjax.training import reporting

PyTree = Any


def memory_analysis(compiled) -> dict:
  """XLA's memory analysis of a compiled program, with `peak_estimate_bytes`
  (donated inputs alias outputs, so they are counted once)."""
  m = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes",
            "temp_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes")
  out = {f: int(getattr(m, f)) for f in fields}
  out["peak_estimate_bytes"] = (out["argument_size_in_bytes"]
                                + out["output_size_in_bytes"]
                                + out["temp_size_in_bytes"]
                                - out["alias_size_in_bytes"])
  return out


# The figures a cost adds up (`combine`, `per_layer_extrapolation`).
FIELDS = ("flops", "bytes_accessed", "seconds", "cycles")


def cost_analysis(compiled) -> dict:
  """XLA's `flops` and `bytes_accessed` of a compiled program, the while
  loops left in it (`while_loops`: XLA counts a loop's body once, whatever
  its trip count) and, where the compiler estimates it (TPU), the program's
  time (`seconds`: None where it does not, or cannot: a `while` loop) and
  its ops' cycles (`cycles`, loops counted per iteration: `program_cycles`;
  else None).

  The two TPU estimates differ: `seconds` (the compiler's
  `optimal_seconds`) prices a matmul at its FLOPs over the chip's bf16
  rate whatever its precision, while `cycles` (the sum of each op's
  `estimated_cycles`, the code generator's own model) counts the bf16
  passes a float32 or X3 product takes, and no overlap between ops.
  """
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
    (analysis,) = analysis
  if analysis is None:  # the GPU compiler without a device gives none
    analysis = generic_cost_analysis(compiled)
  text = compiled.as_text()
  calls = custom_calls(text)
  seconds = analysis.get("optimal_seconds")
  if seconds is not None:
    # The TPU compiler's estimate is the sum of its ops' estimates, an op it
    # has no model for counting -1 s. Its memory-space assignment brings a
    # buffer into fast memory in slices and joins them with a
    # "ConcatBitcast" call that moves no data: those (and the other
    # `FREE_CUSTOM_CALLS`) are added back. Any
    # other unknown op leaves the sum at or below zero (these programs
    # take well under a second per unknown op), reported as None.
    seconds = float(seconds) + sum(calls.get(c, 0) for c in FREE_CUSTOM_CALLS)
  while_loops = len(re.findall(r"\swhile\(", text))
  return {"flops": float(analysis["flops"]),
          "bytes_accessed": float(analysis["bytes accessed"]),
          "seconds": (seconds if seconds and seconds > 0 and not while_loops
                      else None),  # a loop's body is counted once
          "cycles": program_cycles(text),
          "while_loops": while_loops,
          "windowed_einsum_loops": len(re.findall(
              r"\swhile\([^\n]*body=%?[\w.]*windowed_dot_general_body", text)),
          "custom_calls": calls}


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_WHILE = re.compile(r"\swhile\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
# jax's loops count an int32 from 0 by 1 while it is below their length.
_BELOW = re.compile(r"compare\(%?[\w.\-]+, %?([\w.\-]+)\), direction=LT")
_S32_CONSTANT = re.compile(r"%?([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")


def program_cycles(hlo_text: str) -> float | None:
  """The sum of a compiled TPU program's ops' `estimated_cycles` (its code
  generator's own model), a `while` loop's body counted once per iteration:
  the loop program a scanned model runs, costed as compiled. None where
  the text has no such estimates (not a TPU program) or a loop's trip
  count cannot be read: jax's loops run while a counter from 0 is below a
  constant, the condition `compare(counter, N), direction=LT`. (The TPU
  compiler's own windowed-einsum loops count an unsigned counter, from
  where and by how much the text does not say: they are not read.)"""
  lines = {"": []}  # computation -> its instructions ("": outside any)
  name = ""
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      name = head.group(1)
      lines[name] = []
    elif line == "}":
      name = ""
    else:
      lines[name].append(line)
  own = {c: sum(int(x) for l in ls for x in _CYCLES.findall(l))
         for c, ls in lines.items()}
  if not any(own.values()):
    return None
  loops = {c: [m.groups() for m in map(_WHILE.search, ls) if m]
           for c, ls in lines.items()}

  def trip_count(condition: str) -> int | None:
    text = "\n".join(lines.get(condition, ()))
    below, constants = _BELOW.findall(text), dict(_S32_CONSTANT.findall(text))
    return (int(constants[below[0]]) if len(below) == 1
            and below[0] in constants else None)

  def once(c: str) -> float:  # as a sum over the text counts it
    return own[c] + sum(once(body) for _, body in loops[c])

  def each_iteration(c: str) -> float | None:
    if c not in own:
      return None
    total = own[c]
    for condition, body in loops[c]:
      count, inner = trip_count(condition), each_iteration(body)
      if count is None or inner is None:
        return None
      total += count * inner
    return total

  total = float(sum(own.values()))
  bodies = {body for pairs in loops.values() for _, body in pairs}
  for c in set(loops) - bodies:
    for condition, body in loops[c]:
      count, inner = trip_count(condition), each_iteration(body)
      if count is None or inner is None:
        return None  # a loop it cannot count
      total += count * inner - once(body)
  return total


# The TPU compiler splits a matmul whose operand FSDP all-gathers (or whose
# result it reduce-scatters) over many devices into a loop over the shards,
# each iteration's transfer overlapping the previous one's matmul ("windowed
# einsum"; T5-Large over 32 v4 chips: 33 loops). XLA's analyses count a
# loop's body once and the time estimate has no loops: a program compiled
# for its cost is compiled without them (`loop_free_cost`), the same matmuls
# and collectives in sequence, so the estimate leaves out that overlap.
WINDOWED_EINSUM_OFF = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                       "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def loop_free_cost(lowered, mesh, compiled=None) -> dict:
  """`cost_analysis` of the program `lowered` is for `mesh`: of `compiled`
  (its compile, where one is at hand) unless the TPU compiler left
  windowed-einsum loops in it; else, and where none is at hand, of
  `lowered` compiled for its cost, on TPU with those loops off
  (`WINDOWED_EINSUM_OFF`; `windowed_einsum: False` added)."""
  tpu = mesh.devices.flat[0].platform == "tpu"
  if compiled is not None:
    cost = cost_analysis(compiled)
    if not (tpu and cost["windowed_einsum_loops"]):
      return cost
  if not tpu:
    return cost_analysis(lowered.compile())
  return {**cost_analysis(lowered.compile(WINDOWED_EINSUM_OFF)),
          "windowed_einsum": False}


# Custom calls the TPU compiler leaves out of its time estimate (see
# `cost_analysis`) that cost nothing or next to it: relayouts of bytes
# already in place (ConcatBitcast), and the in-place clearing of a buffer's
# padding that FSDP's collectives leave (ZeroCrop; one write of that buffer
# at most, a 512-element mask in the T5 programs).
FREE_CUSTOM_CALLS = ("ConcatBitcast", "ZeroCrop")


def custom_calls(hlo_text: str) -> dict[str, int]:
  """How many custom calls of each target a compiled module's text has."""
  return dict(collections.Counter(
      re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def generic_cost_analysis(compiled) -> dict:
  """XLA's target-independent HLO cost analysis of a compiled program's
  optimized module (its text, parsed and analysed by this host's CPU
  client): the FLOPs and bytes of the ops the target's compiler kept, for
  a compiler that reports none itself. jaxlib exposes this only privately."""
  from jax._src.lib import xla_client
  import jaxlib._hlo as hlo
  module = hlo.hlo_module_from_text(compiled.as_text())
  return xla_client._xla.hlo_module_cost_analysis(
      jax.devices("cpu")[0].client, module)


@dataclasses.dataclass(frozen=True)
class Refusal:
  """A target compiler's refusal to compile a program for want of memory.

  A TPU compiler refuses a program whose temporaries exceed its HBM
  ("RESOURCE_EXHAUSTED: ... HLO temporaries (17.27G) exceeds available HBM
  (15.75G)"), or one whose fusion needs more of a core's scoped on-chip
  memory than it has ("... Ran out of memory in memory space vmem. Used
  16.36M of 16.00M vmem."). Either way the program does not run on that
  target as compiled; only the first names a figure."""
  message: str  # the compiler's own line, without its allocation listing
  temporaries: int | None  # the HBM temporaries it named, in bytes


def refusal(error: Exception) -> Refusal | None:
  """`error` read as a compiler's refusal for memory; None for any other."""
  text = str(error)
  if (not isinstance(error, jax.errors.JaxRuntimeError)
      or "RESOURCE_EXHAUSTED" not in text):
    return None
  line = re.search(r"RESOURCE_EXHAUSTED: ([^\n]*)", text)
  named = re.search(r"temporaries \((\d+(?:\.\d+)?)([KMGT])\)", text)
  return Refusal(
      message=(line.group(1) if line else text.split("\n", 1)[0])[:200],
      temporaries=None if not named else int(
          float(named.group(1)) * 1024 ** ("KMGT".index(named.group(2)) + 1)))


def device_bytes(tree: PyTree) -> int:
  """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s (the
  largest shard of each leaf)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = (x.sharding.shard_shape(x.shape) if x.sharding is not None
             else x.shape)
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


@dataclasses.dataclass(frozen=True)
class StepCost:
  """A logical step's compiled cost (see the module docstring)."""
  peak_bytes: int  # per device
  accumulate_peak_bytes: int  # with the optimizer state resident
  apply_peak_bytes: int
  state_bytes: int  # per device: params, optimizer state, counters
  flops: float | None = None  # None unless asked for (`with_flops`)
  bytes_accessed: float | None = None
  seconds: float | None = None  # the compiler's estimate (TPU), if any
  cycles: float | None = None  # its code generator's (TPU), if any


def abstract_like(tree: PyTree, shardings: PyTree) -> PyTree:
  """`ShapeDtypeStruct`s of `tree`'s leaves carrying `shardings`."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)


def combine(accumulate: Mapping, apply: Mapping, k: int) -> dict:
  """k x `accumulate`'s figures (one microbatch's) + `apply`'s; None where
  either has none (e.g. an extrapolation that could not be made)."""
  parts = {"accumulate": dict(accumulate), "apply": dict(apply)}
  total = {}
  for f in FIELDS:
    one, other = parts["accumulate"].get(f), parts["apply"].get(f)
    total[f] = None if one is None or other is None else k * one + other
  return {**total, "parts": parts}


def _replicated(batch_sharding):
  """Scalars and the key: replicated on the batch's mesh (a compile
  target's devices are not the default device)."""
  return jax.sharding.NamedSharding(batch_sharding.mesh,
                                    jax.sharding.PartitionSpec())


def _abstract_sums(placed):
  return abstract_like(jax.eval_shape(placed.zero_sums,
                                      placed.abstract_state.params),
                       placed.sums_shardings)


def _lower_accumulate(placed, batch_rows, *, m: int, k: int, batch_sharding,
                      mask_sharding):
  """`placed`'s accumulate over [k, m, ...] batches, lowered for abstract
  shapes split as the trainer splits them."""
  state = placed.abstract_state
  index = jax.ShapeDtypeStruct((), np.int32,
                               sharding=_replicated(batch_sharding))
  batch = {f: jax.ShapeDtypeStruct((k, m, *x.shape), x.dtype,
                                   sharding=batch_sharding)
           for f, x in batch_rows.items()}
  mask = jax.ShapeDtypeStruct((k, m), np.float32, sharding=mask_sharding)
  return placed.accumulate.lower(state.params, _abstract_sums(placed), batch,
                                 mask, index, index, state.clip_norms)


def _lower_apply(placed, batch_sharding):
  """`placed`'s apply, lowered for abstract shapes."""
  replicated = _replicated(batch_sharding)
  return placed.apply.lower(
      placed.abstract_state, _abstract_sums(placed),
      jax.ShapeDtypeStruct((4,), np.uint32, sharding=replicated),  # noise key
      jax.ShapeDtypeStruct((), np.float32, sharding=replicated))


def step_cost(placed, batch_rows: Mapping[str, jax.ShapeDtypeStruct], *,
              m: int, k: int, batch_sharding, mask_sharding,
              with_flops: bool = False,
              accumulate_cost: Mapping | None = None) -> StepCost:
  """The compiled cost of one DP step of `placed` (`step.place_steps`) on
  batches [k, m, ...] of rows shaped like `batch_rows` (one example's
  features, e.g. {'inputs': (384,) int32}), split as the trainer splits
  them. Compiles `accumulate` and `apply` once each (and, with `with_flops`
  and k > 1, `accumulate` of one microbatch for the per-step FLOPs), unless
  `accumulate_cost` gives one microbatch's figures (`cost_analysis`'s
  fields; for a model whose layers are a loop, which XLA's analysis counts
  once: `per_layer_extrapolation`; its `cycles` are then the loop
  program's own, each iteration counted, `program_cycles`). The costs are
  `loop_free_cost`'s: on TPU, a program with windowed-einsum loops is
  compiled again for them."""
  shardings = dict(batch_sharding=batch_sharding, mask_sharding=mask_sharding)
  mesh = batch_sharding.mesh
  accumulate_program = _lower_accumulate(placed, batch_rows, m=m, k=k,
                                         **shardings)
  apply_program = _lower_apply(placed, batch_sharding)
  accumulate, apply = accumulate_program.compile(), apply_program.compile()
  state = placed.abstract_state
  state_bytes = device_bytes(state)
  resident = state_bytes - device_bytes(state.params)  # not accumulate's args
  acc_peak = memory_analysis(accumulate)["peak_estimate_bytes"] + resident
  apply_peak = memory_analysis(apply)["peak_estimate_bytes"]
  flops = bytes_accessed = seconds = cycles = None
  if with_flops:
    if accumulate_cost is None and k == 1:
      accumulate_cost = loop_free_cost(accumulate_program, mesh, accumulate)
    elif accumulate_cost is not None:
      accumulate_cost = with_loop_cycles(accumulate_cost, accumulate)
    total = step_estimate(
        placed, batch_rows, m=m, k=k, accumulate=accumulate_cost,
        apply=loop_free_cost(apply_program, mesh, apply), **shardings)
    flops, bytes_accessed = total["flops"], total["bytes_accessed"]
    seconds, cycles = total["seconds"], total["cycles"]
  return StepCost(peak_bytes=max(acc_peak, apply_peak),
                  accumulate_peak_bytes=acc_peak, apply_peak_bytes=apply_peak,
                  state_bytes=state_bytes, flops=flops,
                  bytes_accessed=bytes_accessed, seconds=seconds,
                  cycles=cycles)


def step_estimate(placed, batch_rows: Mapping[str, jax.ShapeDtypeStruct], *,
                  m: int, k: int, batch_sharding, mask_sharding,
                  accumulate: Mapping | None = None,
                  apply: Mapping | None = None) -> dict:
  """`flops`, `bytes_accessed` and `seconds` (`combine`d) of one logical
  step of `placed`, k calls of m, from programs compiled for their cost
  alone (`loop_free_cost`: accumulate over one microbatch, and apply),
  unless their costs are given (`accumulate`: for a scanned model,
  `scanned_accumulate_cost`'s). No memory figure: `step_cost` gives both."""
  if accumulate is None:
    accumulate = accumulate_cost(placed, batch_rows, m=m,
                                 batch_sharding=batch_sharding,
                                 mask_sharding=mask_sharding)
  if apply is None:
    apply = loop_free_cost(_lower_apply(placed, batch_sharding),
                           batch_sharding.mesh)
  return combine(accumulate, apply, k)


def with_loop_cycles(extrapolated: Mapping, loop_program) -> dict:
  """`extrapolated` (`per_layer_extrapolation`'s cost of a scanned model's
  microbatch) with the cycles of the compiled loop program itself, each
  layer as the loop runs it (`program_cycles`), where it has them; the
  extrapolation's kept as `cycles_extrapolated`."""
  loop = cost_analysis(loop_program)["cycles"]
  if loop is None or "extrapolated_to" not in extrapolated:
    return dict(extrapolated)
  return {**extrapolated, "cycles": loop,
          "cycles_extrapolated": extrapolated.get("cycles"),
          "cycles_of": "loop program"}


def per_layer_extrapolation(cost_of: Callable[[Mapping[str, int]], Mapping],
                            layers: Mapping[str, int]) -> dict:
  """`flops`, `bytes_accessed` and `seconds` of a program over a model with
  `layers` (e.g. {'num_encoder_layers': 24, 'num_decoder_layers': 24})
  identical layers per stack, from `cost_of(counts)` (`cost_analysis`'s
  fields) of the same program at one layer per stack and, for each stack,
  at two: each layer of a stack adds what its second one adds.

  For a model whose layers are a loop (`T5Config.scan_layers`), which XLA's
  analysis counts once: `cost_of` compiles it with the loop unrolled
  (`scan_unrolled`, loop-free, so the TPU compiler estimates its time too).
  Exact for FLOPs; for bytes and time, as far as a layer's cost does not
  depend on its neighbours, and as far as the unrolled code moves what the
  loop moves: jax stacks an unrolled loop's per-layer outputs by concatenation
  where the loop writes each layer's in place, so ghost clipping reads a
  scanned site's factors per layer there (`ghost.Site.unrolled`) rather than
  from such a copy of them all. Where a stack's second layer adds less than
  nothing to a field (the compiler laid the one-layer program out unlike the
  others: T5-XL's on v4-32, whose two-layer program moved fewer bytes in less
  time), its third layer's addition is taken for that stack (`cost_of` at
  three); a field still below zero there is None rather than extrapolated
  below zero. `per_layer_from` says which layer's addition each stack took.
  """
  one = {name: 1 for name in layers}
  base = cost_of(one)
  total = {f: base.get(f) for f in FIELDS}
  taken = {}
  for name, count in layers.items():
    if count == 1:
      continue
    second = cost_of({**one, name: 2})
    added, taken[name] = _added(base, second), 2
    if count > 2 and any(a is not None and a < 0 for a in added.values()):
      added, taken[name] = _added(second, cost_of({**one, name: 3})), 3
    for f in FIELDS:
      total[f] = (None if total[f] is None or added[f] is None
                  or added[f] < 0 else total[f] + (count - 1) * added[f])
  return {**total, "extrapolated_to": dict(layers), "per_layer_from": taken}


def _added(before: Mapping, after: Mapping) -> dict:
  """`after - before` for each cost field (None where either is None)."""
  return {f: None if after.get(f) is None or before.get(f) is None
          else after[f] - before[f] for f in FIELDS}


def accumulate_cost(placed, batch_rows: Mapping[str, jax.ShapeDtypeStruct],
                    *, m: int, batch_sharding, mask_sharding) -> dict:
  """The cost of `placed`'s accumulate over one microbatch of m, compiled
  for its cost alone (`loop_free_cost`)."""
  return loop_free_cost(_lower_accumulate(
      placed, batch_rows, m=m, k=1, batch_sharding=batch_sharding,
      mask_sharding=mask_sharding), batch_sharding.mesh)


def scanned_accumulate_cost(place_unrolled: Callable[[Mapping[str, int]], Any],
                            layers: Mapping[str, int],
                            batch_rows: Mapping[str, jax.ShapeDtypeStruct], *,
                            m: int, multiple: int, batch_sharding,
                            mask_sharding) -> dict | None:
  """A scanned model's accumulate cost over one microbatch of m, from its
  loop unrolled at one and two layers per stack (`per_layer_extrapolation`;
  `place_unrolled(counts)`: the run's steps for the model with `counts`
  layers per stack, unrolled).

  Those straight-line programs are compiled for their cost only, and keep
  more alive than the loop the run compiles. Where a target's compiler
  refuses them for its memory at m, they are costed at the largest of
  m / 2, m / 4, ... it compiles (each rounded down to a multiple of the
  data-parallel devices, `multiple`: 160 on 32 devices is followed by 64,
  then 32) and scaled by m over it (`scaled_from_microbatch`; said on the
  console): the FLOPs are per example, so they scale exactly but for the
  sums' accumulation; bytes and time scale the weights' reads too, so they
  are an upper side. None, said, where no such microbatch compiles."""
  for costed in cost_microbatches(m, multiple):
    try:
      cost = per_layer_extrapolation(
          lambda counts: accumulate_cost(
              place_unrolled(counts), batch_rows, m=costed,
              batch_sharding=batch_sharding, mask_sharding=mask_sharding),
          layers)
      break
    except jax.errors.JaxRuntimeError as e:
      refused = refusal(e)
      if refused is None:
        raise
      # An HBM refusal, or the TPU compiler out of a fusion's scoped
      # on-chip memory (T5-XL's on v4-32 at 160 a call once): both
      # programs are costed at a smaller microbatch.
      reporting.say(
          f"cost: the loop-unrolled programs that cost a scanned model's "
          f"layers need {refused.temporaries / 2**30:.2f} GiB of temporaries "
          f"at microbatch {costed}, over the target's memory"
          if refused.temporaries else
          f"cost: the target's compiler could not compile the "
          f"loop-unrolled programs that cost a scanned model's layers at "
          f"microbatch {costed}: {refused.message}")
  else:
    reporting.say("cost: no FLOPs or time estimate")
    return None
  if costed == m:
    return cost
  reporting.say(f"cost: FLOPs, bytes and time costed at microbatch "
                f"{costed} and scaled by {m / costed:g}")
  return {**cost, **{f: None if cost.get(f) is None else cost[f] * m / costed
                     for f in FIELDS},
          "scaled_from_microbatch": costed}


def cost_microbatches(m: int, multiple: int) -> list[int]:
  """m, then m / 2, m / 4, ..., each rounded down to a multiple of
  `multiple` (the data-parallel devices), while positive: the microbatches
  at which `scanned_accumulate_cost` tries the cost programs."""
  sizes = [m]
  while sizes[-1] // 2 // multiple:
    sizes.append(sizes[-1] // 2 // multiple * multiple)
  return sizes
