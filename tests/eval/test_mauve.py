"""MAUVE on feature arrays: separated vs identical clouds, and no torch."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dpjax.eval import mauve


MAUVE_KW = dict(num_buckets=4, kmeans_num_redo=1, kmeans_max_iter=50, seed=1)


def test_mauve_identical_and_separated():
  rng = np.random.default_rng(0)
  p = rng.normal(size=(200, 16))
  assert mauve.mauve(p, p.copy(), **MAUVE_KW) > 0.99
  # Another draw from the same law scores high; far apart clouds score low.
  assert mauve.mauve(p, rng.normal(size=(200, 16)), **MAUVE_KW) > 0.9
  shift = np.zeros(16)
  shift[0] = 10.0
  assert mauve.mauve(p + shift, rng.normal(size=(200, 16)) - shift, **MAUVE_KW) < 0.1
  with pytest.raises(ValueError, match="one width"):
    mauve.mauve(p, p[:, :8])


def test_mauve_imports_neither_torch_nor_transformers():
  code = ("import sys, numpy as np; from dpjax.eval import mauve; "
          "x = np.random.default_rng(0).normal(size=(40, 4)); "
          "mauve.mauve(x, x + 1, num_buckets=2, kmeans_num_redo=1); "
          "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip() == "[]", out.stderr
