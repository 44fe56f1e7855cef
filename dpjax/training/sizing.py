"""Automatic sizing: the fastest microbatch and layout whose step fits.

`MICROBATCH_SIZE = 'auto'` and a model config's `remat = 'auto'` leave the
trade of memory for time to `choose`: it measures candidate steps by their
compiled peak bytes per device (`dpjax.training.step_cost`, abstract shapes: nothing
is allocated) and takes the fastest that fits `headroom` x the device
memory. A candidate is a microbatch and a `Variant`: the remat, and for a
ghost step whose `train.ghost_summation` is 'auto', how the clipped sum is
formed under remat (book-keeping, which keeps the sites' factors, before
the second backward pass, which keeps nothing; `variants`). Faster means
fewer accumulation calls (larger microbatches), then the earlier variant;
where the compiler estimates a step's time (a TPU's, or a TPU target's),
each variant's largest fitting microbatch is costed and the least estimate
wins (`step_cost.step_estimate`; a scanned model's layers through its loop
unrolled at one and two layers per stack).

A step's peak grows with its microbatch, so for each variant the whole
padded batch is tried first (one compile where memory is ample), then the
largest fitting microbatch is searched over the rest (m halving down to one
example per data-parallel device) by interpolation on the near-affine
peak, safeguarded by bisection (`choose`): two or three more compiles
where the peak is affine in m. Without a time estimate a variant is tried
only if it could take fewer calls than the best before it. Device memory:
`train.device_memory` (e.g. '80GiB') when set, else the backend's
`bytes_limit`, else (a CPU) the host's RAM.

The choice and its figures are printed and written to
MODEL_DIR/auto_sizing.json with a fingerprint of everything it depends on
(backend, devices, mesh, model, lengths, batch, clipping, memory, jax
version); a rerun with the same fingerprint takes it without compiling.
Nothing here touches privacy: the sampled batch, its noise and its
accounting are the same whatever the microbatch, remat or summation
(tested: same result).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax

from dpjax.training import checkpoints, partitioning, reporting
from dpjax import errors, fileio
from dpjax.models import common
from dpjax.training import step_cost, targets

FILENAME = "auto_sizing.json"
AUTO = "auto"
REMAT_ORDER = ("none", "layer")  # cheaper first
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
  """12e9, '80GiB', '16 GB', '512MiB' -> bytes."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if value > 0:
      return int(value)
  elif isinstance(value, str):
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if match and match.group(2).lower() in _UNITS:
      try:
        number = float(match.group(1))
      except ValueError:
        number = 0
      if number > 0:
        return int(number * _UNITS[match.group(2).lower()])
  raise errors.UsageError(
      "train.device_memory must be a positive number of bytes or a size "
      f"like '80GiB' or '16GB', got {value!r}")


def device_memory(setting: int | float | str | None,
                  target: targets.Target | None = None) -> tuple[int, str]:
  """(bytes one device may use, where that figure came from):
  `train.device_memory`, else a compile target's HBM per device, else this
  backend's."""
  if setting is not None:
    return parse_bytes(setting), "train.device_memory"
  if target is not None:
    return target.memory_bytes, f"{target.spec} HBM per device"
  stats = jax.local_devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), "backend bytes_limit"
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return int(host // max(jax.local_device_count(), 1)), "host RAM"


def microbatch_candidates(max_batch: int, multiple: int) -> list[int]:
  """Microbatch sizes, largest first: the padded batch split into 1, 2, 4,
  ... calls, each rounded up to a multiple of the data-parallel devices."""
  sizes, calls = [], 1
  while True:
    m = -(-max_batch // calls)
    m = -(-m // multiple) * multiple
    if not sizes or m < sizes[-1]:
      sizes.append(m)
    if m <= multiple:
      return sizes
    calls *= 2


class Variant(NamedTuple):
  """A step's layout for memory, apart from its microbatch: the model's
  remat and ghost clipping's summation (`train.ghost_summation`)."""
  remat: str
  summation: str = "auto"


@dataclasses.dataclass(frozen=True)
class Choice:
  """The sizing a run uses, and how it was found."""
  microbatch_size: int
  remat: str | None  # None: the model's remat was not 'auto'
  accumulation_steps: int  # microbatches per logical step
  peak_bytes: int | None  # per device (None: not measured, or refused
                          # by a compiler that named no figure)
  limit_bytes: int | None
  memory_source: str | None
  fits: bool = True
  # {'microbatch_size', 'remat', 'ghost_summation', 'peak_bytes'}, and
  # 'seconds' for the candidates whose step time was estimated
  tried: tuple[dict, ...] = ()
  ghost_summation: str | None = None  # None: not searched (the setting's)
  seconds: float | None = None  # the compiler's step estimate, if compared

  def to_json(self) -> dict:
    """A plain dict of the fields (JSON-serializable)."""
    return dataclasses.asdict(self)

  def summary(self) -> str:
    """The choice in one console line."""
    remat = "" if self.remat is None else f", remat {self.remat!r}"
    if self.ghost_summation not in (None, AUTO):
      remat += f", ghost summation {self.ghost_summation!r}"
    if self.peak_bytes is None and not self.tried:
      return f"microbatch {self.microbatch_size}{remat}"
    peak = ("refused by the compiler" if self.peak_bytes is None
            else f"peak {self.peak_bytes / 2**30:.2f} GiB")
    timed = ("" if self.seconds is None
             else f", estimated {self.seconds:.4g} s a step")
    return (f"microbatch {self.microbatch_size} x {self.accumulation_steps} "
            f"calls{remat}: {peak} of "
            f"{self.limit_bytes / 2**30:.2f} GiB usable ({self.memory_source})"
            f"{timed}{'' if self.fits else ' -- DOES NOT FIT'}; "
            f"{len(self.tried)} candidates compiled")


def choose(peak_bytes: Callable[[int, Variant], int | None], *,
           sizes: Sequence[int], max_batch: int, variants: Sequence[Variant],
           limit_bytes: int, memory_source: str, floor_bytes: int = 0,
           seconds: Callable[[int, Variant], float | None] | None = None
           ) -> Choice:
  """The fastest candidate (microbatch m, variant) whose `peak_bytes(m,
  variant)` is at most `limit_bytes`, over microbatch `sizes` (largest
  first, e.g. `microbatch_candidates`) for a padded batch of `max_batch`
  and `variants` (the faster at equal calls first, e.g. no remat before
  layer remat). If none fits, the smallest candidate of the last variant,
  marked `fits=False` (the trainer refuses it).

  Fastest is fewest calls, then the earlier variant; with `seconds` (the
  compiler's estimate of a candidate's step time), the least estimate
  among each variant's largest fitting microbatch (its fewest calls),
  where every one of them has an estimate. Without `seconds` a variant is
  searched only below the calls of the best so far; with it, each in full.

  The search is a safeguarded interpolation: a step's peak is close to
  affine in m, so the next size measured is the largest that the line
  through the bracket's ends (the smallest size that did not fit, and the
  largest that did, else `floor_bytes` at m = 0) predicts to fit, or the
  one just above a size that fit, to confirm it. Once a prediction is
  wrong the rest is bisection: two or three compiles where the peak is
  affine, never more than about twice log2(len(sizes)). A peak of None (a
  candidate the compiler refused without a figure) does not fit and
  draws no line."""
  tried: list[dict] = []
  measured: dict[tuple[int, Variant], dict] = {}  # its entry in `tried`

  def fits(i: int, variant: Variant) -> bool:
    peak = peak_bytes(sizes[i], variant)
    peak = None if peak is None else int(peak)
    measured[i, variant] = {"microbatch_size": sizes[i],
                            "remat": variant.remat,
                            "ghost_summation": variant.summation,
                            "peak_bytes": peak}
    tried.append(measured[i, variant])
    return peak is not None and peak <= limit_bytes

  def predicted(lo: int, hi: int, variant: Variant) -> tuple[int, bool] | None:
    """(the index in sizes[lo:hi] the line picks, whether the line says it
    fits); None where there is no usable line."""
    m_up, p_up = sizes[lo - 1], measured[lo - 1, variant]["peak_bytes"]
    m_low, p_low = ((sizes[hi], measured[hi, variant]["peak_bytes"])
                    if (hi, variant) in measured else (0, floor_bytes))
    if p_up is None or p_up <= p_low or m_up <= m_low:
      return None
    m_fit = m_low + (limit_bytes - p_low) * (m_up - m_low) / (p_up - p_low)
    i = next((i for i in range(lo, hi) if sizes[i] <= m_fit), hi - 1)
    return i, sizes[i] <= m_fit

  def largest_fitting(variant: Variant, hi: int) -> int | None:
    """The index of the largest size in sizes[:hi] that fits."""
    if fits(0, variant):  # the whole batch: the common case, one compile
      return 0
    lo, found, interpolate = 1, None, True
    while lo < hi:
      guess = predicted(lo, hi, variant) if interpolate else None
      i, expected = ((lo + hi) // 2, None) if guess is None else guess
      ok = fits(i, variant)
      if ok:
        found, hi = i, i
      else:
        lo = i + 1
      interpolate = interpolate and ok == expected  # bisect once it misses
    return found

  frontier = []  # (index into sizes, variant): each variant's fewest calls
  for variant in variants:
    hi = len(sizes) if seconds or not frontier else frontier[0][0]
    if hi == 0:
      break  # the whole batch fits: nothing takes fewer calls
    found = largest_fitting(variant, hi)
    if found is not None:
      frontier.append((found, variant))
      frontier.sort(key=lambda f: f[0])  # stable: earlier variants first
  fit, estimate = bool(frontier), None
  best = frontier[0] if fit else (len(sizes) - 1, variants[-1])
  if seconds and len(frontier) > 1:
    timed = []
    for i, variant in frontier:
      estimate = seconds(sizes[i], variant)
      measured[i, variant]["seconds"] = estimate
      timed.append((estimate, i, variant))
    if all(t[0] is not None for t in timed):
      estimate, *best = min(timed, key=lambda t: t[0])
    else:
      estimate = None
  peak = measured.get(tuple(best), {}).get("peak_bytes")
  return Choice(microbatch_size=sizes[best[0]], remat=best[1].remat,
                accumulation_steps=-(-max_batch // sizes[best[0]]),
                peak_bytes=peak, limit_bytes=limit_bytes,
                memory_source=memory_source, fits=fit, tried=tuple(tried),
                ghost_summation=best[1].summation, seconds=estimate)


def config_values(model_config, name: str) -> list:
  """The values of field `name` in a model config and its nested configs
  (e.g. GPT2DiscConfig.lm), outermost first."""
  return [getattr(part, name) for part in common.config_parts(model_config)
          if hasattr(part, name)]


def model_remat(model_config) -> str | None:
  """The model config's `remat` ('auto' if any part of it says so)."""
  values = config_values(model_config, "remat")
  return AUTO if AUTO in values else (values[0] if values else None)


def with_remat(model_config, remat: str):
  """`model_config` with every `remat = 'auto'` in it (its own, or a
  part's, e.g. GPT2DiscConfig.lm) set to `remat`."""
  return common.map_parts(model_config, lambda c: (
      dataclasses.replace(c, remat=remat) if getattr(c, "remat", None) == AUTO
      else c))


def peak_or_refusal(compiled_peak: Callable[[], int], floor: int
                    ) -> tuple[int | None, step_cost.Refusal | None]:
  """(`compiled_peak()`, None), or where the target's compiler refused the
  program for want of memory (`step_cost.refusal`), (the peak's lower
  bound, the refusal): `floor` (the resident state) + the temporaries the
  compiler named, which the search can interpolate through, or None where
  it named none (a fusion over a TPU core's on-chip memory): such a
  candidate does not fit, by no figure."""
  try:
    return int(compiled_peak()), None
  except jax.errors.JaxRuntimeError as e:
    refused = step_cost.refusal(e)
    if refused is None:
      raise
    return (None if refused.temporaries is None
            else floor + refused.temporaries), refused


def variants(remat: str | None, summation: str, ghost: bool
             ) -> list[Variant]:
  """The layouts the sizing compares, the faster at equal calls first:
  for `remat` 'auto' no remat, then layer remat (else `remat` alone), each
  with the `summation` set; and where a ghost step (`ghost`) leaves it to
  'auto', under remat book-keeping before 'auto''s second pass (one
  backward pass, fewer FLOPs and bytes; it keeps the sites' factors, so
  more memory)."""
  out = []
  for r in (REMAT_ORDER if remat == AUTO else (remat,)):
    if ghost and summation == AUTO and r not in (None, "none"):
      out.append(Variant(r, "book_keeping"))
    out.append(Variant(r, summation))
  return out


def size_steps(config, max_batch: int, *, mesh, rules, rows: dict,
               place: Callable[..., Any], model_dir: str, dry_run: bool,
               target: targets.Target | None = None, ghost: bool = False
               ) -> tuple[Choice, str | None]:
  """(the microbatch, remat and ghost summation a run uses, the fingerprint
  of an automatic choice): `config`'s (a `RunConfig`) as given, or
  `choose`'s over the steps `place(variant)` (`step.place_steps` of the
  model with that remat and summation; `place(variant, model_config)` for
  another config: a scanned model's layers unrolled to cost them) on
  batches of `rows` (one example's abstract features), over `variants`
  (`ghost`: whether the step clips by ghost with every site's factors
  recordable under remat), taken from MODEL_DIR when recorded there under
  the same fingerprint. Where the compiler estimates time (a TPU, or a TPU
  target), the fitting variants are compared by that estimate. A choice
  that does not fit is refused unless `dry_run` (which reports it)."""
  data_devices = partitioning.data_parallel_size(mesh, rules)
  auto_m = config.microbatch_size == AUTO
  remat = model_remat(config.model_config)
  sizes = microbatch_candidates(max_batch, data_devices)
  if not auto_m:
    fixed = config.microbatch_size or max_batch
    # Above the padded batch a call would only compute more padding rows.
    sizes = [min(-(-fixed // data_devices) * data_devices, sizes[0])]
    if fixed > sizes[0]:
      reporting.say(f"MICROBATCH_SIZE={fixed} is above the padded batch of "
                    f"{max_batch} rows: one call of {sizes[0]}")
  if not auto_m and remat != AUTO:
    return Choice(
        microbatch_size=sizes[0], remat=None,
        accumulation_steps=-(-max_batch // sizes[0]), peak_bytes=None,
        limit_bytes=None, memory_source=None), None
  memory, source = device_memory(config.device_memory, target)
  limit = int(memory * config.memory_headroom)
  key = fingerprint(
      mesh, model=checkpoints.config_json(config.model_config),
      lengths=config.task_feature_lengths, max_batch=max_batch,
      microbatch=config.microbatch_size, mesh=dict(mesh.shape), rules=rules,
      clipping=config.clipping_method, summation=config.ghost_summation,
      ghost=ghost, optimizer=config.optimizer, limit=limit)
  choice = load(model_dir, key)
  if choice is not None:
    reporting.say(f"auto sizing (recorded in {model_dir}): "
                  f"{choice.summary()}")
    return choice, key
  shardings = dict(
      batch_sharding=partitioning.batch_sharding(mesh, 3, batch_dim=1,
                                                 rules=rules),
      mask_sharding=partitioning.batch_sharding(mesh, 2, batch_dim=1,
                                                rules=rules))
  candidates = variants(remat, config.ghost_summation, ghost)
  placed = place(candidates[-1])
  # The state and one clipped sum per loss stay resident whatever the
  # microbatch: if they alone overflow, no candidate is worth compiling.
  floor = step_cost.device_bytes(placed.abstract_state) + (
      step_cost.device_bytes(step_cost.abstract_like(
          jax.eval_shape(placed.zero_sums, placed.abstract_state.params),
          placed.sums_shardings)))

  # Only a TPU's compiler estimates a step's time (`step_cost`).
  timed = mesh.devices.flat[0].platform == "tpu"
  layers = common.scanned_layers(config.model_config)
  estimates = {}  # (m, variant) -> seconds, from a compile for the peak

  def compiled_peak(m: int, variant: Variant) -> int:
    k = -(-max_batch // m)
    # One call of an unrolled model: its compile for the peak costs it too.
    with_cost = timed and k == 1 and not layers
    cost = step_cost.step_cost(place(variant), rows, m=m, k=k,
                               with_flops=with_cost, **shardings)
    if with_cost:
      estimates[m, variant] = cost.seconds
    return cost.peak_bytes

  def peak(m: int, variant: Variant) -> int:
    # A large model's compile takes minutes on a CPU: say what is compiling.
    start = time.perf_counter()
    bytes_, refused = peak_or_refusal(lambda: compiled_peak(m, variant),
                                      floor)
    what = (f"refused by the compiler: {refused.message}" if bytes_ is None
            else f"{'refused by the compiler, peak at least' if refused else 'peak'} "
                 f"{bytes_ / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB")
    reporting.say(f"auto sizing: microbatch {m}, {_described(variant)}: "
                  f"{what} (compiled in {time.perf_counter() - start:.0f} s)")
    return bytes_

  def estimate(m: int, variant: Variant) -> float | None:
    if (m, variant) in estimates:
      return estimates[m, variant]
    model_config = with_remat(config.model_config, variant.remat)
    per_microbatch = step_cost.scanned_accumulate_cost(
        lambda counts: place(variant,
                             common.loop_unrolled(model_config, counts)),
        layers, rows, m=m, multiple=data_devices,
        **shardings) if layers else None
    if layers and per_microbatch is None:
      return None
    return step_cost.step_estimate(place(variant), rows, m=m,
                                   k=-(-max_batch // m),
                                   accumulate=per_microbatch,
                                   **shardings)["seconds"]

  def seconds(m: int, variant: Variant) -> float | None:
    start = time.perf_counter()
    estimate_s = estimate(m, variant)
    reporting.say(
        f"auto sizing: microbatch {m}, {_described(variant)}: "
        + ("no time estimate" if estimate_s is None else
           f"estimated {estimate_s:.4g} s a step")
        + f" (costed in {time.perf_counter() - start:.0f} s)")
    return estimate_s

  if floor > limit:
    choice = Choice(
        microbatch_size=sizes[-1], remat=candidates[-1].remat,
        accumulation_steps=-(-max_batch // sizes[-1]), peak_bytes=floor,
        limit_bytes=limit, memory_source=source, fits=False,
        ghost_summation=candidates[-1].summation)
  else:
    choice = choose(peak, sizes=sizes, max_batch=max_batch,
                    variants=candidates, limit_bytes=limit,
                    memory_source=source, floor_bytes=floor,
                    seconds=seconds if timed else None)
  reporting.say(f"auto sizing: {choice.summary()}")
  if not choice.fits and not dry_run:
    raise errors.UsageError(
        f"no microbatch fits: even {choice.microbatch_size} example(s) per "
        f"call with remat {choice.remat!r} "
        + ("is refused by the target's compiler for its memory"
           if choice.peak_bytes is None else
           f"needs at least {choice.peak_bytes / 2**30:.2f} GiB per device")
        + f", over the {limit / 2**30:.2f} GiB usable ({source} x "
        f"train.memory_headroom {config.memory_headroom}). Shard the params "
        "(gin/performance/fsdp.gin: logical_axis_rules.name = 'fsdp' on an 'fsdp' "
        "mesh), use more devices, or set train.device_memory")
  return choice, key


def _described(variant: Variant) -> str:
  """The variant on the console; a summation only where it is set."""
  return f"remat {variant.remat!r}" + (
      "" if variant.summation == AUTO
      else f", ghost summation {variant.summation!r}")


def fingerprint(device_mesh, **facts: Any) -> str:
  """A digest of what a choice depends on, with the mesh's devices (the
  backend's, or a compile target's) and the jax version."""
  device = device_mesh.devices.flat[0]
  facts.update(jax=jax.__version__, platform=device.platform,
               device_kind=device.device_kind,
               devices=device_mesh.devices.size)
  text = json.dumps(facts, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()


def load(model_dir: str, key: str) -> Choice | None:
  """The choice recorded in `model_dir` for this fingerprint, if any."""
  try:
    with open(os.path.join(model_dir, FILENAME)) as f:
      saved = json.load(f)
    if saved.get("fingerprint") != key:
      return None
    fields = saved["choice"]
    return Choice(**{**fields, "tried": tuple(fields.get("tried", ()))})
  except (OSError, ValueError, KeyError, TypeError):
    return None  # absent or unreadable: measured again


def save(model_dir: str, key: str, choice: Choice) -> None:
  """Records `choice` for fingerprint `key` in `model_dir` (atomically)."""
  fileio.write_atomic(os.path.join(model_dir, FILENAME), json.dumps(
      {"fingerprint": key, "choice": choice.to_json()}, indent=2))
