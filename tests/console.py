"""What a command printed itself: its stderr without the native libraries'
startup lines (TensorFlow's; jax's CUDA plugin, in the test extra for
compile targets, loaded without a driver), which C++ logging writes before
any of dpjax runs and which no Python setting turns off."""
from __future__ import annotations

import re

_NATIVE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\] )")


def own_lines(text: str) -> list[str]:
  """The non-empty lines of `text` that are not native startup logging."""
  return [line for line in text.splitlines()
          if line.strip() and not _NATIVE.match(line)]
