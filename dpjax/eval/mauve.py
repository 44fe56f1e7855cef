"""MAUVE (Pillutla et al., 2021) of generated against human text features.

Every pipeline scores its synthetic text with it on features from a dpjax
model (semantic parsing: a GPT-2's last hidden state; retrieval: mean-pooled
T5 encoder states), so mauve-text only ever sees feature arrays.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys

import numpy as np


class _Refuse(importlib.abc.MetaPathFinder):
  """Makes importing the given top-level packages fail (as if absent)."""

  def __init__(self, names):
    self.names = set(names)

  def find_spec(self, fullname, path, target=None):
    if fullname.partition(".")[0] in self.names:
      raise ModuleNotFoundError(f"{fullname} is not imported here", name=fullname)
    return None


@functools.cache
def _compute_mauve():
  """mauve-text's `compute_mauve`, imported without torch and transformers.

  mauve-text imports both at import time when they are installed, only to
  featurize raw text, which is never asked of it here; that would cost
  seconds and load a second framework. Its imports are guarded, so refusing
  them just records them as absent.
  """
  refuse = _Refuse(n for n in ("torch", "transformers") if n not in sys.modules)
  sys.meta_path.insert(0, refuse)
  try:
    from mauve import compute_mauve
  finally:
    sys.meta_path.remove(refuse)
  return compute_mauve


def mauve(p_features: np.ndarray, q_features: np.ndarray, **kwargs) -> float:
  """MAUVE (Pillutla et al., 2021) between two sets of text features.

  A thin wrapper of mauve-text's `compute_mauve(p_features=...,
  q_features=...)`: the features are L2-normalized, reduced by PCA, quantized
  by k-means into `num_buckets` clusters (default: one per 10 texts), and
  MAUVE is the area under the divergence curve of the two cluster
  histograms; 1 means indistinguishable.

  Args:
    p_features: `[n, d]` features of the human (reference) texts, e.g. from
      `text_features`.
    q_features: `[m, d]` features of the generated texts.
    **kwargs: passed on to `compute_mauve` (e.g. `num_buckets`, `seed`,
      `kmeans_num_redo`, `kmeans_max_iter`, `mauve_scaling_factor`).
  """
  p, q = np.asarray(p_features, np.float32), np.asarray(q_features, np.float32)
  if p.ndim != 2 or q.ndim != 2 or p.shape[1] != q.shape[1] or not len(p) or not len(q):
    raise ValueError(f"Features must be non-empty [n, d] arrays of one width; got shapes "
                     f"{p.shape} and {q.shape}.")
  return float(_compute_mauve()(p_features=p, q_features=q, **kwargs).mauve)
