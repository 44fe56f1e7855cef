"""`python -m dpjax.bench --suite=gpu`: the comparison set as one table, with
the targets it is measured against.

  python -m dpjax.bench --suite=gpu [--budget_s=540] [--json_out=rows.jsonl] \\
      [--no_cost] [--autotune_dir=DIR]

Rows, in the order they run (the most telling first, so a tight budget
still answers the main question):
  1. GPT-2 small, 32 x 256, bf16: nodp, vmap, ghost, jax_privacy;
  2. GPT-2 small at batch 64: nodp and ghost;
  3. T5-Base, 32 x (384 + 128): nodp and ghost;
  4. the largest batch that fits: ghost, then jax_privacy, at growing
     batches (no microbatching), each ladder stopping at its first row that
     runs out of device memory;
  5. T5-XL, 32 x 512, ghost with layer remat, `--memory_only` (compiled,
     nothing allocated: does it fit one device?). Last, since a `--target`
     compile from any host answers that too, and the rows above need the
     device.
Every row is one `python -m dpjax.bench` in its own process, so each peak
memory is that row's alone and an out-of-memory row cannot disturb the next;
this process never touches a device (it would hold the memory the rows
need).
Rows that would start after `--budget_s` are listed as skipped; a running
row is stopped at the budget.

Targets (an H100's):
  * a DP step (ghost) at most 1.10x the nodp step at the same batch;
  * DP throughput at the largest batch that fits at least 3x jax-privacy's
    at its own largest;
  * nodp MFU at least 35%.
Each is printed as met, not met, or n/a (a row it needs did not run, e.g.
jax-privacy not installed). `--suite=smoke` is the same set on tiny models
(seconds on a CPU): it checks the harness, not a machine.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, NamedTuple, Sequence

STEP_TARGET, THROUGHPUT_TARGET, MFU_TARGET = 1.10, 3.0, 0.35


class Spec(NamedTuple):
  """The sizes of a suite (`rows` makes its rows)."""
  gpt2: str
  seq: int
  t5: str
  t5_lengths: tuple[int, int]
  xl: str
  xl_seq: int
  batch: int
  big_batch: int
  ghost_ladder: tuple[int, ...]
  jax_privacy_ladder: tuple[int, ...]
  common: tuple[str, ...]


SUITES = {
    "gpu": Spec(gpt2="gpt2_small", seq=256, t5="t5_base", t5_lengths=(384, 128),
                xl="t5_xl", xl_seq=512, batch=32, big_batch=64,
                ghost_ladder=(128, 256, 512), jax_privacy_ladder=(64, 128, 256),
                common=("--dtype=bfloat16",)),
    "smoke": Spec(gpt2="gpt2_tiny", seq=16, t5="t5_tiny", t5_lengths=(16, 8),
                  xl="t5_tiny", xl_seq=16, batch=4, big_batch=8,
                  ghost_ladder=(16,), jax_privacy_ladder=(8,),
                  common=("--dtype=float32", "--vocab=128", "--steps=2",
                          "--warmup=1")),
}


class Row(NamedTuple):
  """One row of a suite: its `python -m dpjax.bench` flags and its ladder."""
  argv: tuple[str, ...]  # for `python -m dpjax.bench`
  ladder: str | None = None  # rows of one ladder stop at the first OOM


def rows(spec: Spec) -> list[Row]:
  """The suite's rows, in the order they run."""
  def row(model, batch, mode, *extra, ladder=None):
    return Row((f"--model={model}", f"--batch={batch}", f"--mode={mode}",
                *extra, *spec.common), ladder)

  gpt2 = (f"--seq={spec.seq}",)
  t5 = (f"--input_length={spec.t5_lengths[0]}",
        f"--target_length={spec.t5_lengths[1]}")
  return [
      *(row(spec.gpt2, spec.batch, mode, *gpt2)
        for mode in ("nodp", "vmap", "ghost", "jax_privacy")),
      *(row(spec.gpt2, spec.big_batch, mode, *gpt2)
        for mode in ("nodp", "ghost")),
      *(row(spec.t5, spec.batch, mode, *t5) for mode in ("nodp", "ghost")),
      *(row(spec.gpt2, b, "ghost", *gpt2, ladder="ghost")
        for b in spec.ghost_ladder),
      *(row(spec.gpt2, b, "jax_privacy", *gpt2, ladder="jax_privacy")
        for b in spec.jax_privacy_ladder),
      row(spec.xl, spec.batch, "ghost", f"--seq={spec.xl_seq}",
          "--remat=layer", "--memory_only"),
  ]


def autotune_file(directory: str, argv: Sequence[str]) -> str:
  """Where the row of `argv` writes XLA's autotuning results: one file a
  row (each process writes its own results over the file's)."""
  name = re.sub(r"[^A-Za-z0-9.]+", "_", " ".join(argv)).strip("_")
  return os.path.join(directory, f"{name}.textproto")


def run_row(argv: Sequence[str], timeout_s: float,
            autotune_dir: str | None = None) -> dict:
  """One `python -m dpjax.bench` in a fresh process: its JSON line. With
  `autotune_dir`, the GPU compiler also writes the results of its autotuning
  there (`autotune_file`; text `AutotuneResults`, which
  `--xla_gpu_load_autotune_results_from` reads back)."""
  command = [sys.executable, "-m", "dpjax.bench", *argv]
  env = None
  if autotune_dir:
    flag = ("--xla_gpu_dump_autotune_results_to="
            + autotune_file(autotune_dir, argv))
    env = dict(os.environ,
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip())
  try:
    proc = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=max(timeout_s, 1))
  except subprocess.TimeoutExpired:
    return {"error": f"stopped at the budget after {timeout_s:.0f} s"}
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if lines:
    return json.loads(lines[-1])
  return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}


def run_suite(spec: Spec, *, budget_s: float,
              run: Callable[[Sequence[str], float], dict] = run_row,
              say: Callable[[str], None] = lambda s: None) -> list[dict]:
  """Each row's result (with `argv`), skipping what the budget or an
  out-of-memory rung of its ladder rules out."""
  deadline = time.monotonic() + budget_s
  results, stopped = [], set()
  for row in rows(spec):
    left = deadline - time.monotonic()
    if row.ladder in stopped:
      result = {"skipped": "a smaller batch did not fit"}
    elif left <= 0:
      result = {"skipped": "time budget spent"}
    else:
      say(" ".join(row.argv))
      result = run(row.argv, left)
      if row.ladder and "error" in result:
        stopped.add(row.ladder)
    results.append({**result, "argv": list(row.argv), "ladder": row.ladder})
  return results


def _arg(result: dict, name: str) -> str | None:
  return next((a.split("=", 1)[1] for a in result["argv"]
               if a.startswith(f"--{name}=")), None)


def _ran(result: dict) -> bool:
  return "step_time_s" in result


def _shape_key(result: dict) -> list[str]:
  return [a for a in result["argv"] if not a.startswith("--mode=")]


def _nodp_of(result: dict, results: list[dict]) -> dict | None:
  """The nodp row of the same model, batch and shape, if it ran."""
  return next((r for r in results if _ran(r) and _arg(r, "mode") == "nodp"
               and _shape_key(r) == _shape_key(result)), None)


def _shape(result: dict) -> str:
  lengths = [_arg(result, "seq")] if _arg(result, "seq") else [
      _arg(result, "input_length"), _arg(result, "target_length")]
  return f"{_arg(result, 'batch')} x ({' + '.join(lengths)})"


def step_ratio(result: dict, results: list[dict]) -> float | None:
  """Step time over the nodp step at the same model and batch."""
  nodp = _nodp_of(result, results)
  if not _ran(result) or nodp is None:
    return None
  return result["step_time_s"] / nodp["step_time_s"]


def targets(spec: Spec, results: list[dict]) -> list[tuple[str, float | None,
                                                             bool | None]]:
  """(target, measured value, met) for each of the suite's targets."""
  ghost = [r for r in results if _ran(r) and _arg(r, "mode") == "ghost"]
  ratios = [x for r in ghost if (x := step_ratio(r, results)) is not None]
  worst = max(ratios, default=None)

  def best(mode, key):
    values = [r[key] for r in results if _ran(r) and r.get(key) is not None
              and _arg(r, "mode") == mode and _arg(r, "model") == spec.gpt2]
    return max(values, default=None)

  dp, jp = best("ghost", "tokens_per_s"), best("jax_privacy", "tokens_per_s")
  throughput = dp / jp if dp and jp else None
  nodp_mfu = best("nodp", "mfu")
  return [
      (f"DP step (ghost) <= {STEP_TARGET:.2f}x nodp at equal batch (worst)",
       worst, None if worst is None else worst <= STEP_TARGET),
      (f"DP tokens/s at the largest batch >= {THROUGHPUT_TARGET:.0f}x "
       "jax-privacy's", throughput,
       None if throughput is None else throughput >= THROUGHPUT_TARGET),
      (f"nodp MFU >= {MFU_TARGET:.0%}", nodp_mfu,
       None if nodp_mfu is None else nodp_mfu >= MFU_TARGET),
  ]


def cell(x, fmt: str) -> str:
  """A table cell: `x` in `fmt`, empty for None."""
  return "" if x is None else format(x, fmt)


def met_cell(met: bool | None) -> str:
  """A target's "met" cell: yes, no, or n/a (a row it needs did not run)."""
  return "n/a" if met is None else "yes" if met else "no"


def table(spec: Spec, results: list[dict], command: str) -> str:
  """The markdown table of the rows, then the targets."""
  ran = next((r for r in results if "device_kind" in r), {})
  out = [f"{ran.get('device_kind', '?')} x {ran.get('num_devices', '?')}, jax "
         f"{ran.get('jax_version', '?')}, `{command}`", "",
         "| model | shape | mode | step ms | tokens/s | x nodp | MFU | "
         "peak GiB | FLOPs x nodp | note |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
  for r in results:
    peak = r.get("peak_memory_bytes") or (
        r.get("memory_analysis") or {}).get("peak_estimate_bytes")
    nodp = _nodp_of(r, results)
    flops_ratio = (r["flops"] / nodp["flops"] if nodp and r.get("flops")
                   else None)
    note = (r.get("error") or r.get("skipped")
            or ("memory only" if "--memory_only" in r["argv"] else ""))
    mode = _arg(r, "mode") + (f" remat={_arg(r, 'remat')}"
                              if _arg(r, "remat") else "")
    out.append(
        f"| {_arg(r, 'model')} | {_shape(r)} | {mode} | "
        f"{cell(r.get('step_time_s') and 1e3 * r['step_time_s'], '.1f')} | "
        f"{cell(r.get('tokens_per_s'), ',.0f')} | "
        f"{cell(step_ratio(r, results), '.3f')} | "
        f"{cell(r.get('mfu'), '.1%')} | {cell(peak and peak / 2**30, '.2f')} "
        f"| {cell(flops_ratio, '.3f')} | {note[:80]} |")
  out += ["", "| target | measured | met |", "|---|---:|---|"]
  for name, value, met in targets(spec, results):
    out.append(f"| {name} | {cell(value, '.3f')} | "
               f"{met_cell(met)} |")
  return "\n".join(out)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parses the flags of `python -m dpjax.bench --suite=NAME`."""
  p = argparse.ArgumentParser(
      prog="python -m dpjax.bench --suite",
      description="A fixed comparison set of dpjax.bench rows as one table.")
  p.add_argument("--suite", choices=sorted(SUITES), required=True)
  p.add_argument("--budget_s", type=float, default=540,
                 help="wall-clock budget of the whole suite (default 9 min)")
  p.add_argument("--json_out", help="also write every row's JSON line here")
  p.add_argument("--no_cost", action="store_true",
                 help="skip each row's cost analysis (two compiles fewer a "
                 "row; a --target compile of the row gives its FLOPs)")
  p.add_argument("--autotune_dir",
                 help="GPU: write each row's XLA autotuning results here, "
                 "one text file a row")
  return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
  """Runs `python -m dpjax.bench --suite=NAME`; returns the exit status."""
  args = parse_args(argv)
  spec = SUITES[args.suite]
  if args.no_cost:
    spec = spec._replace(common=(*spec.common, "--no_cost"))
  if args.autotune_dir:
    os.makedirs(args.autotune_dir, exist_ok=True)
  results = run_suite(spec, budget_s=args.budget_s,
                      run=functools.partial(run_row,
                                            autotune_dir=args.autotune_dir),
                      say=lambda s: print(f"dpjax.bench: {s}", file=sys.stderr,
                                          flush=True))
  if args.json_out:
    with open(args.json_out, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in results)
  print(table(spec, results, "python -m dpjax.bench " + " ".join(argv)),
        flush=True)
  return 0
