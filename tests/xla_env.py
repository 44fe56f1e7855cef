"""The XLA flags the suite compiles under, and the environments of the
processes tests start.

The suite's programs are tiny and each runs a few times, so compiling them
dominates its time (docs/benchmarks.md, "Where the suite's time goes").
`FAST_COMPILE` makes code generation cheap: LLVM at level 0 without its
expensive passes, XLA:CPU's classic elemental emitters instead of its MLIR
fusion emitters, and each module generated on one thread (the two xdist
workers already fill both cores). The tests check values, never speed; runs
compared bit for bit compile under the same flags. The classic emitters
lower a scatter as a `while` loop, so a test of what XLA's default pipeline
leaves in a CPU program compiles in `default_codegen()`.
"""
from __future__ import annotations

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0",
                "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1")
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _flags(keep) -> list[str]:
  return [f for f in os.environ.get("XLA_FLAGS", "").split() if keep(f)]


def with_devices(devices: int, **overrides: str) -> dict[str, str]:
  """`os.environ` with `devices` virtual CPU devices (the count must be in
  XLA_FLAGS before jax starts, hence a process of its own), the suite's
  other flags kept, TensorFlow quiet, and `overrides` set last."""
  flags = _flags(lambda f: not f.startswith(_COUNT_FLAG))
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
              XLA_FLAGS=" ".join([*flags, f"{_COUNT_FLAG}={devices}"]),
              **overrides)


def default_codegen(**overrides: str) -> dict[str, str]:
  """`os.environ` without `FAST_COMPILE`: XLA's own code generation."""
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
              XLA_FLAGS=" ".join(_flags(lambda f: f not in FAST_COMPILE)),
              **overrides)
