"""Compile targets: the TPU slice or GPUs a run is planned for, from any
machine.

  python -m dpjax.train --gin_file=gin/msmarco_t5_xl_eps3.gin --dry_run \\
      --target=tpu:v4:2x2x4      # or gpu:h100:1x8

XLA does not need the device to compile for it. With libtpu installed (the
`[tpu]` extra), `jax.experimental.topologies.get_topology_desc` returns the
devices of a TPU slice on a CPU-only host, and a `jit(...).lower(...)
.compile()` over a mesh of them runs the real TPU compiler: its memory
analysis is the TPU program's and its cost analysis carries
`optimal_seconds`, the compiler's own estimate of the program's time. With
jax's CUDA plugin (`jax[cuda12-local]`: the plugin and its PJRT, no driver)
and a `GpuTargetConfigProto` (the device description: SMs, compute
capability, shared memory, memory size and bandwidth, clock; one per GPU in
`dpjax/gpu_specs/`, from the vendor's figures), the same compiles through
LLVM, PTX and ptxas (from a CUDA toolkit on the host) for that GPU. The plan
(`dpjax.training.dry_run`) and the automatic sizing (`dpjax.training.sizing`) then use the
target's devices and memory instead of the host's.

A target is `tpu:<generation>:<topology>` (v4 and v5p topologies are 3-D:
`tpu:v4:2x2x4` is a v4-32, 16 chips of two devices; v5e and v6e 2-D:
`tpu:v5e:16x16`), a Cloud TPU accelerator type (`tpu:v4-32`,
`tpu:v5litepod-256`: its default topology) or `gpu:<name>[:<hosts>x<gpus per host>]` (`gpu:h100`,
`gpu:h100:1x8`). Memory and peak FLOP/s are the vendor's published figures
(dense bf16), a TPU chip's split evenly over its devices.

Limits: the figures are the compiler's for one program on one target; they
do not include host input time, collectives' contention with other jobs, or
the runtime's own reserve (the sizing headroom is for that). The GPU
compiler has no device to autotune on, so its GEMMs use default tiles and
algorithms: their workspace, and so the peak, can differ from the device's
by the autotuner's choice (typically a few hundred MiB), and the GPU
compiler gives no time estimate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import math
import os
import re

import jax

from dpjax import errors

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's chip: its HBM and dense bf16 peak (Cloud TPU
  documentation), and how many dimensions its topologies have."""
  hbm_bytes: int
  peak_bf16_flops: float
  dims: int


TPU_CHIPS = {
    "v4": Chip(32 * GiB, 275e12, 3),
    "v5e": Chip(16 * GiB, 197e12, 2),
    "v5p": Chip(95 * GiB, 459e12, 3),
    "v6e": Chip(32 * GiB, 918e12, 2),
}


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU: its `dpjax/gpu_specs/` file and dense bf16 peak (NVIDIA's
  datasheets, without sparsity)."""
  spec_file: str
  peak_bf16_flops: float


GPUS = {
    "h100": Gpu("h100.txtpb", 989e12),
    "h200": Gpu("h200.txtpb", 989e12),
    "a100-80gb": Gpu("a100-80gb.txtpb", 312e12),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices a run is compiled for, and what one of them offers."""
  spec: str
  platform: str  # 'tpu' or 'gpu'
  devices: tuple  # the compiler's devices (`jax.Device`s of a topology)
  chips: int  # TPU chips, or GPUs
  memory_bytes: int  # per device
  peak_flops: float  # per device, dense bf16


def _known() -> str:
  return ", ".join([*(f"tpu:{g}:{'x'.join(['2'] * c.dims)}"
                      for g, c in TPU_CHIPS.items()),
                    *(f"gpu:{name}[:1x8]" for name in GPUS)])


# Cloud TPU accelerator types (`gcloud ... --accelerator-type=v4-32`): the
# generation, and whether the number counts TensorCores (two a chip) or chips.
_ACCELERATOR_TYPES = {"v4": ("v4", 2), "v5p": ("v5p", 2),
                      "v5litepod": ("v5e", 1), "v5e": ("v5e", 1),
                      "v6e": ("v6e", 1)}


def accelerator_topology(accelerator_type: str) -> str:
  """A Cloud TPU accelerator type's default topology target:
  'v4-32' -> 'tpu:v4:2x2x4', 'v5litepod-16' -> 'tpu:v5e:4x4' (Cloud TPU's
  slice shapes: from 2x2(x1), the smallest dimension that is not the
  largest doubled, all equal: the last)."""
  match = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator_type)
  if not match or match.group(1) not in _ACCELERATOR_TYPES:
    raise errors.UsageError(
        f"--target tpu:{accelerator_type}: expected a Cloud TPU accelerator "
        f"type like v4-32, v5p-8, v5litepod-16 or v6e-8")
  generation, per_chip = _ACCELERATOR_TYPES[match.group(1)]
  chips = int(match.group(2)) // per_chip
  dims = [2, 2, 1] if TPU_CHIPS[generation].dims == 3 else [2, 2]
  if chips < 4 or chips & (chips - 1):
    if chips == 1 and len(dims) == 2:
      return f"tpu:{generation}:1x1"
    raise errors.UsageError(
        f"--target tpu:{accelerator_type}: give the topology instead "
        f"(tpu:{generation}:{'x'.join(['2'] * len(dims))})")
  while math.prod(dims) < chips:
    growing = [i for i, d in enumerate(dims) if d < max(dims)]
    i = growing[-1] if len(dims) == 3 and growing else (
        growing[0] if growing else len(dims) - 1)
    dims[i] *= 2
  return f"tpu:{generation}:{'x'.join(map(str, dims))}"


def parse(spec: str) -> tuple[str, str, tuple[int, ...]]:
  """'tpu:v5e:2x2' -> ('tpu', 'v5e', (2, 2)); a Cloud accelerator type
  'tpu:v4-32' -> ('tpu', 'v4', (2, 2, 4)); 'gpu:h100' -> ('gpu', 'h100',
  (1, 1)); a UsageError naming what is known otherwise."""
  if re.fullmatch(r"tpu:[a-z0-9]+-\d+", spec or ""):
    spec = accelerator_topology(spec[len("tpu:"):])
  match = re.fullmatch(r"(tpu|gpu):([a-z0-9-]+)(?::(\d+(?:x\d+)*))?",
                       spec or "")
  kind, name = (match.group(1), match.group(2)) if match else (None, None)
  known = TPU_CHIPS if kind == "tpu" else GPUS
  if not match or name not in known or (kind == "tpu" and not match.group(3)):
    raise errors.UsageError(f"--target {spec!r}: expected one of {_known()}"
                             " (any topology of that shape)")
  shape = tuple(int(d) for d in (match.group(3) or "1x1").split("x"))
  dims = TPU_CHIPS[name].dims if kind == "tpu" else 2
  if len(shape) != dims or 0 in shape:
    example = ("x".join(["2"] * dims) if kind == "tpu" else "1x8")
    what = f"a {name} topology" if kind == "tpu" else "gpu:NAME:HOSTSxGPUS"
    raise errors.UsageError(f"--target {spec!r}: {what} has {dims} "
                             f"dimensions, e.g. {kind}:{name}:{example}")
  return kind, name, shape


def gpu_target_config(name: str) -> str:
  """The `GpuTargetConfigProto` text of a known GPU (`GPUS`)."""
  return importlib.resources.files("dpjax").joinpath(
      "gpu_specs", GPUS[name].spec_file).read_text()


def resolve(spec: str) -> Target:
  """The target of `spec` (`parse`), its devices from its compiler: a
  UsageError if the compiler is not installed or rejects the topology."""
  kind, name, shape = parse(spec)
  from jax.experimental import topologies
  config = gpu_target_config(name) if kind == "gpu" else None
  try:
    if kind == "tpu":  # compiling takes no TPU: share libtpu with any process
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
      topology = topologies.get_topology_desc(
          platform="tpu", topology_name=f"{name}:{'x'.join(map(str, shape))}")
    else:
      topology = topologies.get_topology_desc(
          platform="cuda", target_config=config,
          topology=f"1x{shape[0]}x{shape[1]}")
  except (RuntimeError, NotImplementedError) as e:  # JaxRuntimeError too
    reason = " ".join(str(e).split())[:300]
    if "support not installed" in reason or "not implemented" in reason:
      install = ('pip install -e ".[tpu]"' if kind == "tpu" else
                 'pip install "jax[cuda12-local]" (the plugin, no driver)')
      raise errors.UsageError(
          f"--target {spec}: the {kind.upper()} compiler is not installed "
          f"here ({reason}): {install}") from None
    raise errors.UsageError(f"--target {spec}: {reason}") from None
  devices = tuple(topology.devices)
  if kind == "gpu":
    memory = int(re.search(r"device_memory_size:\s*(\d+)", config).group(1))
    return Target(spec=spec, platform="gpu", devices=devices,
                  chips=len(devices), memory_bytes=memory,
                  peak_flops=GPUS[name].peak_bf16_flops)
  chips = math.prod(shape)
  chip = TPU_CHIPS[name]
  per_chip = len(devices) // chips
  return Target(spec=spec, platform="tpu", devices=devices, chips=chips,
                memory_bytes=chip.hbm_bytes // per_chip,
                peak_flops=chip.peak_bf16_flops / per_chip)


@contextlib.contextmanager
def without_persistent_cache():
  """Compiles for a target bypass jax's persistent compilation cache: an
  executable compiled without the device's client cannot be read back, so
  an entry would cost a write and a failed read, never a hit."""
  from jax.experimental.compilation_cache import compilation_cache
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # jax decides once whether it uses one
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def compiling_for(target: Target | None):
  """The context a command compiles in: `without_persistent_cache` for a
  target, nothing special for this host's backend."""
  return without_persistent_cache() if target else contextlib.nullcontext()
