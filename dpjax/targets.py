"""Compile targets: the TPU slice a run is planned for, from any machine.

  python -m dpjax.train --gin_file=gin/msmarco_t5_xl_eps3.gin --dry_run \\
      --target=tpu:v4:2x2x4

XLA does not need the device to compile for it. With libtpu installed (the
`[tpu]` extra), `jax.experimental.topologies.get_topology_desc` returns the
devices of a TPU slice on a CPU-only host, and a `jit(...).lower(...)
.compile()` over a mesh of them runs the real TPU compiler: its memory
analysis is the TPU program's and its cost analysis carries
`optimal_seconds`, the compiler's own estimate of the program's time. The
plan (`dpjax.dry_run`) and the automatic sizing (`dpjax.sizing`) then use
the slice's devices and memory instead of the host's.

A target is `tpu:<generation>:<topology>`: v4 and v5p topologies are 3-D
(`tpu:v4:2x2x4` is a v4-32: 16 chips, 32 TensorCores), v5e and v6e 2-D
(`tpu:v5e:16x16`). The compiler's devices are what jax would see on the
slice (a v4 chip is two devices, a v5p chip one). Memory and peak FLOP/s per
chip are the vendor's published figures (Cloud TPU documentation), split
evenly over a chip's devices.

Limits: the figures are the compiler's for one program on one slice; they
do not include host input time, collectives' contention with other jobs, or
the runtime's own reserve (the sizing headroom is for that).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import jax

from dpjax import gin_cli

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
class Target:
  """The devices a run is compiled for, and what one of them offers."""
  spec: str
  platform: str  # jax's: 'tpu'
  devices: tuple  # the compiler's devices (`jax.Device`s of a topology)
  chips: int
  memory_bytes: int  # per device
  peak_flops: float  # per device, dense bf16

  @property
  def device_kind(self) -> str:
    return self.devices[0].device_kind


def parse(spec: str) -> tuple[str, str, tuple[int, ...]]:
  """'tpu:v5e:2x2' -> ('tpu', 'v5e', (2, 2)); a UsageError naming what is
  known otherwise."""
  known = ", ".join(f"tpu:{g}:{'x'.join(['2'] * c.dims)}"
                    for g, c in TPU_CHIPS.items())
  match = re.fullmatch(r"(tpu):([a-z0-9]+):(\d+(?:x\d+)*)", spec or "")
  if not match or match.group(2) not in TPU_CHIPS:
    raise gin_cli.UsageError(f"--target {spec!r}: expected one of {known} "
                             "(any topology of that shape)")
  generation = match.group(2)
  shape = tuple(int(d) for d in match.group(3).split("x"))
  if len(shape) != TPU_CHIPS[generation].dims or 0 in shape:
    raise gin_cli.UsageError(
        f"--target {spec!r}: a {generation} topology has "
        f"{TPU_CHIPS[generation].dims} dimensions, e.g. "
        f"tpu:{generation}:{'x'.join(['2'] * TPU_CHIPS[generation].dims)}")
  return match.group(1), generation, shape


def resolve(spec: str) -> Target:
  """The target of `spec` (`parse`), its devices from the TPU compiler:
  a UsageError if libtpu is missing or rejects the topology."""
  _, generation, shape = parse(spec)
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=f"{generation}:{'x'.join(map(str, shape))}")
  except RuntimeError as e:  # jax.errors.JaxRuntimeError too
    reason = " ".join(str(e).split())[:300]
    if "support not installed" in reason:
      raise gin_cli.UsageError(
          f"--target {spec}: the TPU compiler (libtpu) is not installed: "
          "pip install -e \".[tpu]\"") from None
    raise gin_cli.UsageError(f"--target {spec}: {reason}") from None
  devices = tuple(topology.devices)
  chips = math.prod(shape)
  chip = TPU_CHIPS[generation]
  per_chip = len(devices) // chips
  return Target(spec=spec, platform="tpu", devices=devices, chips=chips,
                memory_bytes=chip.hbm_bytes // per_chip,
                peak_flops=chip.peak_bf16_flops / per_chip)


@contextlib.contextmanager
def without_persistent_cache():
  """Compiles for a target bypass jax's persistent compilation cache: an
  executable compiled without the device's client cannot be read back, so
  an entry would cost a write and a failed read, never a hit."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
