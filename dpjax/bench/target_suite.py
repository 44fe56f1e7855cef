"""`python -m dpjax.bench --suite=targets`: the cost of DP on TPUs and GPUs,
from their own compilers on this host (nothing runs, no device needed).

  python -m dpjax.bench --suite=targets [--targets=tpu:v5e:2x2,gpu:h100] \\
      [--models=gpt2_small,t5_base,t5_xl] [--json_out=rows.jsonl]

For each target (default: a v5e, a v4 and a v6e 2x2 slice, one H100) and
model (GPT-2 small 32 x 256, T5-Base 32 x (384 + 128), T5-XL 32 x (512 +
512) with layer remat, its layers scanned (one compiled per stack) and its
params sharded over the slice, FSDP), each
mode (nodp, vmap, ghost, jax_privacy) gets
  1. the step at the batch of 32 in one call (`python -m dpjax.bench
     --target`): peak memory per device, FLOPs and bytes per device, and on
     a TPU the compiler's estimate of the step's time. Where the target's
     compiler refuses that step for want of memory, the same at half the
     batch, and so on down to one example a device (`fitting_row`); its
     ratios to nodp are then to nodp's step scaled to that batch
     (`at_batch`: accumulate scales with the batch, apply does not);
  2. the largest batch per device that fits the target's memory x
     `--headroom`: a power of two, searched with `dpjax.training.sizing.choose`
     from row 1's peak (memory-only compiles of the whole step, usually
     two per mode);
  3. examples/s there, from row 1's estimate: accumulate's time per example
     x that batch + apply's time (the per-example part scales with the
     batch, the update does not; a larger batch only uses a device better,
     so this errs low).
Every compile is its own process (`suite.run_row`), so the host memory a
large compile holds is returned before the next. `--scan_layers` scans
T5-Base's layers too: its 24 unrolled layers' ghost program for a v5e
holds more than 22 GB of host memory in the TPU compiler, the scanned one
about 5 GB. Ghost book-keeps through the loop as it does unrolled
(`privacy/ghost.py`: each site's factors leave the loop stacked per layer).

Targets, each printed met, not met or n/a:
  * ghost's step at most 1.10 x nodp's at equal batch, by the TPU
    compiler's estimate (`optimal_seconds`, a roofline), and again by its
    code generator's per-op cycles (which count a product's bf16 passes;
    a scanned model's are its loop program's, each iteration counted);
  * DP (ghost) examples/s at its largest batch at least 3 x jax-privacy's at
    its own, beside its ceiling: nodp's examples/s over jax-privacy's.
`--suite=targets_smoke` is the same on tiny models and one small slice:
it checks the harness, not a machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, NamedTuple, Sequence

from dpjax import errors
from dpjax.training import run_config, sizing, targets
from dpjax.bench import step, suite

MODES = ("nodp", "vmap", "ghost", "jax_privacy")
STEP_TARGET, THROUGHPUT_TARGET = suite.STEP_TARGET, suite.THROUGHPUT_TARGET
# A training run's default share of device memory, so that "fits" means
# what the trainer's sizing means by it.
HEADROOM = next(f.default for f in dataclasses.fields(run_config.RunConfig)
                if f.name == "memory_headroom")


class Model(NamedTuple):
  """A model of a target suite: its name and its `dpjax.bench` flags."""
  name: str
  args: tuple[str, ...]  # shape, remat and mesh flags of `dpjax.bench`


class Spec(NamedTuple):
  """A target suite: its compile targets, models, batches and common flags."""
  targets: tuple[str, ...]
  models: tuple[Model, ...]
  batch: int  # the batch of row 1, in one call
  max_per_device: int  # the largest batch per device the search tries
  common: tuple[str, ...]
  modes: tuple[str, ...] = MODES


FSDP = ("--mesh=fsdp:-1", "--rules=fsdp")
SUITES = {
    "targets": Spec(
        targets=("tpu:v5e:2x2", "tpu:v4:2x2x1", "tpu:v6e:2x2",
                 "gpu:h100:1x1"),
        models=(Model("gpt2_small", ("--seq=256",)),
                Model("t5_base", ("--input_length=384",
                                  "--target_length=128")),
                Model("t5_xl", ("--seq=512", "--remat=layer", "--scan_layers",
                                *FSDP))),
        batch=32, max_per_device=1024, common=("--dtype=bfloat16",)),
    "targets_smoke": Spec(
        targets=("tpu:v5e:2x2",),
        models=(Model("gpt2_tiny", ("--seq=16",)),),
        batch=8, max_per_device=16,
        common=("--dtype=float32", "--vocab=128")),
}


def _argv(spec: Spec, target: str, model: Model, mode: str, batch: int,
          *extra: str) -> tuple[str, ...]:
  return (f"--model={model.name}", f"--batch={batch}", f"--microbatch={batch}",
          f"--mode={mode}", f"--target={target}", *model.args, *spec.common,
          *extra)


def _peak(result: dict) -> int | None:
  return (result.get("memory_analysis") or {}).get("peak_estimate_bytes")


def largest_batch(run: Callable[[Sequence[str]], dict], argv_at:
                  Callable[[int], Sequence[str]], first: dict, *,
                  devices: int, memory_bytes: int, headroom: float,
                  max_per_device: int, known: Sequence[dict] = ()) -> dict:
  """The largest power-of-two batch per device whose step fits `headroom` x
  `memory_bytes`: `sizing.choose` over memory-only compiles `run(argv_at(
  global batch))`, from the first power of two above what the line through
  `first` (a compiled row: its batch and peak) and its state (the
  arguments' bytes, at batch 0) predicts, so that two compiles usually
  settle it; where that top fits too (a compiler's peak can grow slower
  than the line), doubling until one does not. A compile that fails (e.g.
  the TPU compiler refusing a program over its HBM) does not fit. `known`:
  an earlier search's entries, reused instead of compiled again."""
  limit = int(memory_bytes * headroom)
  floor = first["memory_analysis"]["argument_size_in_bytes"]
  b1, p1 = first["batch"] / devices, _peak(first)
  guess = (b1 * (limit - floor) / (p1 - floor) if p1 > floor
           else max_per_device)
  top = 1
  while top <= guess and top < max_per_device:
    top *= 2
  tried = {k["batch_per_device"] * devices: k for k in known}

  def peak_bytes(batch: int, variant: sizing.Variant | None = None) -> int:
    del variant  # the model's own, fixed by the row's flags
    if batch == first["batch"]:
      return p1
    if batch not in tried:
      r = run(argv_at(batch))
      tried[batch] = {"batch_per_device": batch // devices,
                      "peak_bytes": _peak(r),
                      **({"error": r["error"][:200]} if "error" in r else {})}
    return tried[batch]["peak_bytes"] or 2**62  # failed: fits nothing

  sizes = [top * devices >> i for i in range(top.bit_length())]
  choice = sizing.choose(peak_bytes, sizes=sizes, max_batch=sizes[0],
                         variants=[sizing.Variant("none")],
                         limit_bytes=limit,
                         memory_source="target", floor_bytes=floor)
  best = choice.microbatch_size if choice.fits else None
  while best == top * devices and top < max_per_device:
    top *= 2
    if peak_bytes(top * devices) > limit:
      break
    best = top * devices
  return {"largest_batch_per_device": best and best // devices,
          "largest_batch_peak_bytes": best and peak_bytes(best),
          "limit_bytes": limit, "search": list(tried.values())}


def fitting_row(row_at: Callable[[int], dict], batch: int) -> dict:
  """Row 1: `row_at(batch)`, or where the target's compiler refuses that
  step for want of device memory, the step at the largest power-of-two
  fraction of `batch` it compiles, down to one example a device, with the
  refused batches and their errors as `refused`. So a model too large for
  the suite's batch on a small slice (T5-XL's DP modes on a 2x2 one) still
  gets its costs, at a batch that fits."""
  result, refused = row_at(batch), []
  while (result.get("error", "").startswith(step.OUT_OF_MEMORY)
         and batch // 2 >= result.get("num_devices", batch)):
    refused.append({"batch": batch, "error": result["error"][:200]})
    batch //= 2
    result = row_at(batch)
  return {**result, "refused": refused} if refused else result


# A step's totals and the `cost_parts` fields they are the sums of.
_PART_FIELDS = {"flops": "flops", "bytes_accessed": "bytes_accessed",
                "step_time_estimate_s": "seconds", "cycles": "cycles"}


def _from_parts(result: dict, part_field: str, batch: int) -> float | None:
  """`part_field` of `result`'s step at `batch` in one call, from its
  `cost_parts` (accumulate of its batch, apply): accumulate scales with the
  batch, apply does not. None where a part lacks it."""
  parts = result.get("cost_parts") or {}
  acc, apply = ((parts.get(part) or {}).get(part_field)
                for part in ("accumulate", "apply"))
  if acc is None or apply is None:
    return None
  return acc * batch / result["microbatch"] + apply


def at_batch(result: dict, field: str, batch: int) -> float | None:
  """`field` (a key of `_PART_FIELDS`) of `result`'s step at `batch` in one
  call: its own where that is its batch, else `_from_parts`."""
  if result.get("batch") == batch:
    return result.get(field)
  return _from_parts(result, _PART_FIELDS[field], batch)


def step_seconds(result: dict, batch: int) -> float | None:
  """The step's time at `batch` in one call, from the compiler's estimate of
  `result`'s parts (`_from_parts`)."""
  return _from_parts(result, "seconds", batch)


def run_suite(spec: Spec, *, headroom: float,
              run: Callable[[Sequence[str]], dict],
              memory_of: Callable[[str], int],
              say: Callable[[str], None] = lambda s: None,
              keep: Callable[[dict], None] = lambda r: None,
              done: Sequence[dict] = ()) -> list[dict]:
  """One result per (target, model, mode): row 1's JSON line with
  `largest_batch_per_device`, its `search` and `examples_per_s_at_largest`,
  each passed to `keep` as it is done (a whole suite takes hours). `done`:
  results of an earlier run of the suite (`--resume`), whose row 1 and
  search compiles are reused."""
  earlier = {tuple(r["argv"]): r for r in done}
  results = []
  for target in spec.targets:
    memory = memory_of(target)
    for model in spec.models:
      for mode in spec.modes:
        argv = _argv(spec, target, model, mode, spec.batch)

        def row_at(batch: int) -> dict:
          at = _argv(spec, target, model, mode, batch)
          say(" ".join(at))
          return run(at)

        # Keyed by the suite's batch (`--resume`), at whichever batch it fit.
        result = earlier.get(argv) or {
            **fitting_row(row_at, spec.batch), "argv": list(argv),
            "suite_target": target, "suite_model": model.name,
            "suite_mode": mode}
        devices = result.get("num_devices")  # the target's
        if "error" not in result and devices:
          say(f"largest batch: {target} {model.name} {mode}")
          result.update(largest_batch(
              run, lambda b: _argv(spec, target, model, mode, b, "--no_cost"),
              result, devices=devices, memory_bytes=memory, headroom=headroom,
              max_per_device=spec.max_per_device,
              known=result.get("search", ())))
          best = result["largest_batch_per_device"]
          seconds = best and step_seconds(result, best * devices)
          result["examples_per_s_at_largest"] = (
              seconds and best * devices / seconds)
        keep(result)
        results.append(result)
  return results


def _of(results: list[dict], target: str, model: str, mode: str) -> dict:
  return next((r for r in results if (r["suite_target"], r["suite_model"],
                                      r["suite_mode"]) == (target, model,
                                                           mode)), {})


def _cycles_of(result: dict) -> str | None:
  """Where a row's accumulate cycles come from: its loop program
  (`step_cost.with_loop_cycles`), or None (its own loop-free program, or
  a scanned model's extrapolation where its loops could not be counted)."""
  return ((result.get("cost_parts") or {}).get("accumulate") or {}).get(
      "cycles_of")


def ratio(results: list[dict], r: dict, field: str) -> float | None:
  """`field` of `r` over the nodp row's of the same target and model at
  `r`'s batch (`at_batch`: where a row fit only a smaller batch than the
  suite's, nodp's step is scaled down to it, which errs against `r`: a
  smaller batch uses a device less well); None for cycles counted two ways
  (one row's from its loop program, the other's extrapolated: a loop whose
  trip count the text does not give)."""
  nodp = _of(results, r["suite_target"], r["suite_model"], "nodp")
  if r.get(field) is None or not nodp.get(field):
    return None
  if field == "cycles" and _cycles_of(r) != _cycles_of(nodp):
    return None
  base = at_batch(nodp, field, r.get("batch"))
  return r[field] / base if base else None


def targets_met(spec: Spec, results: list[dict]) -> list[tuple[
    str, str, float | None, bool | None, str]]:
  """(target, model, the measured value, met, a note) per compile target and
  model for each of the suite's targets: ghost's step over nodp's by the TPU
  compiler's estimate (`optimal_seconds`), the same by its code generator's
  cycles, then ghost's examples/s at its largest batch over jax-privacy's.

  The throughput's note is its ceiling: nodp's own examples/s at its largest
  batch over jax-privacy's. A DP step that costs at least nodp's and fits
  no larger batch reaches no further, so where the ceiling is under the
  target, no such step meets it on that target and model.
  """
  out = []
  for target in spec.targets:
    for model in spec.models:
      where = f"{target} {model.name}"
      ghost = _of(results, target, model.name, "ghost")
      nodp = _of(results, target, model.name, "nodp")
      scaled = ("" if ghost.get("batch") == nodp.get("batch") else
                f"at ghost's batch {ghost.get('batch')}, nodp's step scaled "
                "to it")
      for field, by in (("step_time_estimate_s", "TPU estimate"),
                        ("cycles", "TPU cycles")):
        step_ratio = ratio(results, ghost, field) if ghost else None
        out.append((where, f"ghost step <= {STEP_TARGET:.2f}x nodp ({by})",
                    step_ratio,
                    None if step_ratio is None else step_ratio <= STEP_TARGET,
                    scaled if step_ratio is not None else ""))
      jp_rate = _of(results, target, model.name,
                    "jax_privacy").get("examples_per_s_at_largest")
      dp_rate = ghost.get("examples_per_s_at_largest")
      nodp_rate = nodp.get("examples_per_s_at_largest")
      throughput = dp_rate / jp_rate if dp_rate and jp_rate else None
      ceiling = nodp_rate / jp_rate if nodp_rate and jp_rate else None
      out.append((where, f"ghost examples/s at its largest batch >= "
                  f"{THROUGHPUT_TARGET:.0f}x jax-privacy's", throughput,
                  None if throughput is None
                  else throughput >= THROUGHPUT_TARGET,
                  "" if ceiling is None else
                  f"nodp's own: {ceiling:.3f}x"))
  return out


def table(spec: Spec, results: list[dict], command: str) -> str:
  """The markdown table of the results, then the targets."""
  out = [f"`{command}`", "",
         "| target | model | mode | batch | peak / device GiB | "
         "FLOPs × nodp | bytes × nodp | est. step ms | × nodp | "
         "largest batch / device | its peak GiB | est. examples/s there | "
         "note |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  for r in results:
    seconds = r.get("step_time_estimate_s")
    peak_largest = r.get("largest_batch_peak_bytes")
    refused = ", ".join(str(x["batch"]) for x in r.get("refused", ()))
    note = r.get("error") or (refused and f"refused at {refused} (out of "
                              "memory); × nodp at this batch")
    out.append(
        f"| `{r['suite_target']}` | {r['suite_model']} | {r['suite_mode']} | "
        f"{suite.cell(r.get('batch'), 'd')} | "
        f"{suite.cell(_peak(r) and _peak(r) / 2**30, '.2f')} | "
        f"{suite.cell(ratio(results, r, 'flops'), '.3f')} | "
        f"{suite.cell(ratio(results, r, 'bytes_accessed'), '.3f')} | "
        f"{suite.cell(seconds and 1e3 * seconds, '.2f')} | "
        f"{suite.cell(ratio(results, r, 'step_time_estimate_s'), '.3f')} | "
        f"{suite.cell(r.get('largest_batch_per_device'), 'd')} | "
        f"{suite.cell(peak_largest and peak_largest / 2**30, '.2f')} | "
        f"{suite.cell(r.get('examples_per_s_at_largest'), ',.0f')} | "
        f"{(note or '')[:80]} |")
  out += ["", "| target, model | target | measured | met | note |",
          "|---|---|---:|---|---|"]
  for where, name, value, met, note in targets_met(spec, results):
    out.append(f"| {where} | {name} | {suite.cell(value, '.3f')} | "
               f"{suite.met_cell(met)} | {note} |")
  return "\n".join(out)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parses and checks the flags of `python -m dpjax.bench --suite=targets`."""
  p = argparse.ArgumentParser(
      prog="python -m dpjax.bench --suite=targets",
      description="DP's cost on TPU slices and GPUs, by their compilers.")
  p.add_argument("--suite", choices=sorted(SUITES), required=True)
  p.add_argument("--targets", help="comma-separated compile targets "
                 "(dpjax.training.targets; default: the suite's)")
  p.add_argument("--models", help="comma-separated subset of the suite's "
                 "models (default: all)")
  p.add_argument("--modes", help="comma-separated subset of the modes "
                 f"{','.join(MODES)} (default: all; a target is judged only "
                 "where the modes it compares ran)")
  p.add_argument("--headroom", type=float, default=HEADROOM,
                 help="the share of a device's memory a step may use "
                 "(default: train.memory_headroom's)")
  p.add_argument("--timeout_s", type=float, default=3600,
                 help="the longest one compile may take")
  p.add_argument("--json_out", help="also write every row's JSON line here")
  p.add_argument("--resume", action="store_true",
                 help="reuse the rows and compiles already in --json_out")
  p.add_argument("--scan_layers", action="store_true",
                 help="compile every scannable model's layers as a loop, one "
                 "layer per stack (T5-Base; T5-XL always is): less host "
                 "memory for the compiler")
  args = p.parse_args(argv)
  if args.resume and not args.json_out:
    p.error("--resume reads the rows of --json_out")
  return args


def select(spec: Spec, args: argparse.Namespace) -> Spec:
  """The suite narrowed to `--targets`, `--models` and `--modes`, its
  scannable models scanned with `--scan_layers`."""
  if args.targets:
    spec = spec._replace(targets=tuple(args.targets.split(",")))
  if args.models:
    names = args.models.split(",")
    unknown = set(names) - {m.name for m in spec.models}
    if unknown:
      raise errors.UsageError(f"--models: {sorted(unknown)} not in the "
                               f"suite's {[m.name for m in spec.models]}")
    spec = spec._replace(models=tuple(m for m in spec.models
                                      if m.name in names))
  if args.modes:
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
      raise errors.UsageError(f"--modes: {sorted(unknown)} not in {MODES}")
    spec = spec._replace(modes=tuple(m for m in MODES if m in modes))
  if args.scan_layers:
    spec = spec._replace(models=tuple(
        m._replace(args=(*m.args, "--scan_layers"))
        if step.scannable(m.name) and "--scan_layers" not in m.args else m
        for m in spec.models))
  return spec


def main(argv: Sequence[str]) -> int:
  """Runs `python -m dpjax.bench --suite=targets`; returns the exit status."""
  args = parse_args(argv)
  try:
    spec = select(SUITES[args.suite], args)
    memory = {t: targets.resolve(t).memory_bytes for t in spec.targets}
  except errors.UsageError as e:  # before anything is compiled or written
    print(f"error: {e}", file=sys.stderr)
    return 2
  done = []
  if args.resume and os.path.exists(args.json_out):
    with open(args.json_out) as f:
      done = [json.loads(line) for line in f if line.strip()]
  out = open(args.json_out, "w") if args.json_out else None
  ours = {_argv(spec, t, m, mode, spec.batch) for t in spec.targets
          for m in spec.models for mode in spec.modes}
  for row in done:  # rows of targets or models not run this time: kept
    if tuple(row["argv"]) not in ours:
      out.write(json.dumps(row) + "\n")

  def keep(result: dict) -> None:
    if out:
      out.write(json.dumps(result) + "\n")
      out.flush()

  results = run_suite(
      spec, headroom=args.headroom,
      run=lambda a: suite.run_row(a, args.timeout_s), memory_of=memory.get,
      say=lambda s: print(f"dpjax.bench: {s}", file=sys.stderr, flush=True),
      keep=keep, done=done)
  if out:
    out.close()
  print(table(spec, results, "python -m dpjax.bench " + " ".join(argv)),
        flush=True)
  return 0
