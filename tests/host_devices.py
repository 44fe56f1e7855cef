"""The environment of a test's subprocess with N virtual CPU devices.

The device count has to be in XLA_FLAGS before jax starts, so such a test
runs its code in a child process. The child keeps the suite's other XLA flags
(`tests/conftest.py`: cheaper code generation), so it compiles as fast as
the test process does."""
from __future__ import annotations

import os

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def env(devices: int, **overrides: str) -> dict[str, str]:
  """`os.environ` with `devices` CPU devices, on CPU, TensorFlow quiet, and
  `overrides` set last."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith(_COUNT_FLAG)]
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
              XLA_FLAGS=" ".join([*flags, f"{_COUNT_FLAG}={devices}"]),
              **overrides)
