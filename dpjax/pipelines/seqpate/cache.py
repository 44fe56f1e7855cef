"""On-disk cache of the teachers' top-k next-token distributions.

Each teacher group writes one file, `group-0003.npz` (written to a temporary
file and renamed, so a file is whole or absent), holding for every
pseudo-data sentence s and position j (the distribution of token j + 1 given
tokens 0..j) each teacher's `top_k` token ids and probabilities:

    teacher_ids [G] int32, token_ids [G, P, L, k] int32,
    probs [G, P, L, k] float32, fingerprint (of the pseudo-data), vocab_size

A teacher's probability of a token outside its top-k counts as 0, so each
teacher contributes a sub-probability vector (probs >= 0, summing to at most
1; `write_group` scales a row down where float rounding of the softmax takes
its sum above 1). That is the premise of the sqrt(2) sensitivity
(`dpjax.pipelines.seqpate.accounting`).

`TeacherSums.from_cache` merges the groups into the sparse sum over all
teachers, so the noisy aggregation only looks up the candidates it needs:
the sum of the distributions, or (`aggregate="votes"`) the histogram of the
teachers' top-1 tokens, i.e. the sum of point masses at each teacher's most
likely token (the first of its top-k list on a tie), itself a
sub-probability vector.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import os

import numpy as np

from dpjax import fileio

GROUP_PATTERN = "group-{:04d}.npz"


def fingerprint(tokens: np.ndarray) -> str:
  """Identifies the pseudo-data a cache was computed on."""
  tokens = np.ascontiguousarray(tokens, np.int32)
  h = hashlib.sha256(repr(tokens.shape).encode())
  h.update(tokens.tobytes())
  return h.hexdigest()


def group_path(cache_dir: str, group: int) -> str:
  """The cache file of group `group` in `cache_dir`."""
  return os.path.join(cache_dir, GROUP_PATTERN.format(group))


def write_group(cache_dir: str, group: int, teacher_ids: np.ndarray,
                token_ids: np.ndarray, probs: np.ndarray, *,
                pseudo_fingerprint: str, vocab_size: int) -> str:
  """Writes one group's top-k distributions atomically; returns the path."""
  teacher_ids = np.asarray(teacher_ids, np.int32)
  token_ids = np.asarray(token_ids, np.int32)
  probs = np.asarray(probs, np.float32)
  if token_ids.shape != probs.shape or token_ids.ndim != 4:
    raise ValueError(f"token_ids {token_ids.shape} and probs {probs.shape} "
                     "must both be [G, P, L, k].")
  if token_ids.shape[0] != len(teacher_ids):
    raise ValueError(f"{len(teacher_ids)} teacher ids for "
                     f"{token_ids.shape[0]} teachers.")
  if token_ids.min() < 0 or token_ids.max() >= vocab_size:
    raise ValueError(f"token ids outside [0, {vocab_size}).")
  if probs.min() < 0 or not np.isfinite(probs).all():
    raise ValueError("probabilities must be finite and >= 0.")
  total = probs.sum(-1, keepdims=True, dtype=np.float64)
  probs = (probs / np.maximum(total, 1.0)).astype(np.float32)
  os.makedirs(cache_dir, exist_ok=True)
  path = group_path(cache_dir, group)
  with fileio.open_atomic(path, "wb") as f:
    np.savez(f, teacher_ids=teacher_ids, token_ids=token_ids, probs=probs,
             fingerprint=np.array(pseudo_fingerprint),
             vocab_size=np.array(vocab_size, np.int64))
  return path


def group_paths(cache_dir: str) -> list[str]:
  """The group files in `cache_dir`, sorted by group."""
  return sorted(glob.glob(os.path.join(cache_dir, "group-*.npz")))


@dataclasses.dataclass(frozen=True)
class TeacherSums:
  """The sum over all teachers of their top-k distributions (or of their
  top-1 votes: `aggregate`), sparse.

  `keys` (sorted, unique) encode (sentence s, position j, token v) as
  `(s * L + j) * vocab_size + v`; `values` are the summed probabilities or
  vote counts (float64). Tokens in no teacher's top-k (no vote) have sum 0.
  """
  keys: np.ndarray
  values: np.ndarray
  num_sentences: int
  num_positions: int
  vocab_size: int
  num_teachers: int
  fingerprint: str
  aggregate: str = "distribution"

  @classmethod
  def from_cache(cls, cache_dir: str, num_teachers: int, *,
                 pseudo_fingerprint: str | None = None,
                 aggregate: str = "distribution") -> TeacherSums:
    """Merges every group file; checks that teachers 0..num_teachers-1 each
    appear exactly once and that all groups saw the same pseudo-data.
    `aggregate`: "distribution" sums the top-k probabilities, "votes" counts
    each teacher's top-1 token."""
    if aggregate not in ("distribution", "votes"):
      raise ValueError(f"aggregate must be 'distribution' or 'votes', got "
                       f"{aggregate!r}")
    paths = group_paths(cache_dir)
    if not paths:
      raise FileNotFoundError(f"no teacher cache files in {cache_dir!r}")
    keys = np.zeros(0, np.int64)
    values = np.zeros(0, np.float64)
    seen = []
    shape = fp = vocab = None
    for path in paths:
      with np.load(path) as group:
        ids, probs = group["token_ids"], group["probs"]
        meta = (ids.shape[1:], str(group["fingerprint"]),
                int(group["vocab_size"]))
        if shape is None:
          shape, fp, vocab = meta
        elif meta != (shape, fp, vocab):
          raise ValueError(f"{path}: pseudo-data, top_k or vocabulary differ "
                           f"from {paths[0]}")
        seen.append(group["teacher_ids"])
      if aggregate == "votes":  # a point mass at each teacher's top-1
        top = np.argmax(probs, -1)[..., None]
        ids = np.take_along_axis(ids, top, -1)
        probs = np.ones(ids.shape, np.float32)
      num_sentences, num_positions = shape[0], shape[1]
      rows = np.arange(num_sentences * num_positions, dtype=np.int64)
      group_keys = (rows[None, :, None] * vocab
                    + ids.reshape(ids.shape[0], -1, ids.shape[-1]))
      keys, inverse = np.unique(
          np.concatenate([keys, group_keys.ravel()]), return_inverse=True)
      values = np.bincount(
          inverse, np.concatenate([values, probs.ravel().astype(np.float64)]),
          minlength=len(keys))
    if pseudo_fingerprint is not None and fp != pseudo_fingerprint:
      raise ValueError(f"cache {cache_dir!r} was computed on other pseudo-data.")
    teachers = np.sort(np.concatenate(seen))
    if not np.array_equal(teachers, np.arange(num_teachers)):
      missing = sorted(set(range(num_teachers)) - set(teachers.tolist()))
      raise ValueError(f"cache {cache_dir!r} must hold teachers 0.."
                       f"{num_teachers - 1} once each; missing {missing[:10]}, "
                       f"{len(teachers)} entries.")
    return cls(keys, values, num_sentences, num_positions, vocab, num_teachers,
               fp, aggregate)

  def restricted(self, sentences: np.ndarray, positions: np.ndarray,
                 candidates: np.ndarray) -> np.ndarray:
    """`[Q, C]` teacher sums at the candidate tokens of each (sentence,
    position) query; 0 where a candidate is -1 (padding)."""
    sentences = np.asarray(sentences, np.int64)
    positions = np.asarray(positions, np.int64)
    candidates = np.asarray(candidates, np.int64)
    row = sentences * self.num_positions + positions
    wanted = row[:, None] * self.vocab_size + np.maximum(candidates, 0)
    at = np.minimum(np.searchsorted(self.keys, wanted), len(self.keys) - 1)
    hit = (self.keys[at] == wanted) & (candidates >= 0)
    return np.where(hit, self.values[at], 0.0)
