"""Exact top-k inner-product search, streamed over corpus embedding shards.

The corpus is never in memory whole: shards come one at a time, and each
query block keeps a running top-k that every shard's candidates are merged
into. Order: score descending, ties by a per-document integer tie key
ascending (`tie_keys`; default the corpus position). `trec_tie_keys` gives
the key of trec_eval's order, document id descending, so that the top k
kept are the first k of trec_eval's ranking of the whole corpus even when
tied scores (duplicated passages) straddle the cut, and the run file lists
them in the order trec_eval evaluates them. Both back ends pick the same
documents:

* "device" (the default): a jitted fixed-shape step on JAX's default
  devices, an accelerator or the host: a float32 matmul at full precision
  (no TF32/bf16 passes, so it agrees with the host), then the k best of
  [running, shard] candidates by (score, key): `lax.top_k` gives the k-th
  score, everything above it is kept, and of the candidates tied at it the
  ones with the smallest keys fill the remaining places (`_best_k`; about
  1.2x the time of one `lax.top_k` merge on a CPU). Query blocks are split
  over the mesh's data axes; the shard is replicated.
* "cpu": the same merge in numpy (`np.partition` for the k-th largest score,
  the ties at it resolved by key only in rows with more ties than places).
  Without an accelerator XLA's CPU step is still faster, so this is the path
  for a host whose JAX devices are busy, and a cross-check.
"""
from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.training import partitioning

BACKENDS = ("device", "cpu")
_NO_KEY = np.iinfo(np.int32).max  # padding: after every document
_LOW_BITS = 16  # tie keys split in halves below 2**24 (exact in float32)


def trec_tie_keys(doc_ids: Iterable[str]) -> np.ndarray:
  """int32 `[n]`: each document's place in trec_eval's order of tied scores.

  trec_eval sorts a query's documents by score, then by document id
  descending (`strcmp`, i.e. UTF-8 bytes, which Python's `str` order
  matches); key 0 goes first. Ids must be distinct (the readers check).
  """
  doc_ids = list(doc_ids)
  if len(doc_ids) >= _NO_KEY:
    raise ValueError(f"{len(doc_ids)} documents: too many for int32 tie keys")
  order = sorted(range(len(doc_ids)), key=doc_ids.__getitem__, reverse=True)
  keys = np.empty(len(doc_ids), np.int32)
  keys[np.asarray(order, np.int64)] = np.arange(len(doc_ids), dtype=np.int32)
  return keys


def _top_k(x, k):
  """`lax.top_k` kept whole: without the barrier XLA's CPU compiler turns a
  top_k whose values are sliced into a full sort (50x slower)."""
  return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def _best_k(scores, keys, k):
  """Positions of each row's k best by (score desc, key asc), in no particular
  order. Keys are distinct except the padding's (score -inf, key `_NO_KEY`).

  `lax.top_k` gives the k-th score; everything above it is kept, and of the
  entries tied at it the `room` with the smallest keys. Integer top_k is slow
  on some back ends, so that choice is made on keys split into two halves
  exact in float32: the smallest high halves, then among the entries at the
  boundary high half the smallest low halves.
  """
  top, _ = _top_k(scores, k)
  kth = top[:, k - 1:k]
  above, tied = scores > kth, scores == kth
  room = k - above.sum(1, keepdims=True)  # places left for ties, 1 .. k

  def rank_th_smallest(values, mask, rank):  # rank in 1 .. k, mask holds >= rank
    low, _ = _top_k(jnp.where(mask, -values.astype(jnp.float32), -jnp.inf), k)
    return (-jnp.take_along_axis(low, rank - 1, axis=1)).astype(jnp.int32)

  high, low = keys >> _LOW_BITS, keys & ((1 << _LOW_BITS) - 1)
  high_cut = rank_th_smallest(high, tied, room)
  below = tied & (high < high_cut)
  at_cut = tied & (high == high_cut)
  low_cut = rank_th_smallest(low, at_cut, room - below.sum(1, keepdims=True))
  keep = above | below | (at_cut & (low <= low_cut))
  # The kept entries are exactly k, except when fewer than k are finite (the
  # -inf padding ties, all of it kept); finite ones first either way.
  _, positions = _top_k(jnp.where(keep, scores, -jnp.inf), k)
  return positions


@functools.partial(jax.jit, static_argnames="k")
def _merge_shard(queries, shard, shard_keys, num_valid, offset, best_scores,
                 best_ids, best_keys, *, k):
  scores = jnp.matmul(queries, shard.T, precision=jax.lax.Precision.HIGHEST)
  valid = jnp.arange(shard.shape[0]) < num_valid
  scores = jnp.where(valid, scores, -jnp.inf)
  keys = jnp.broadcast_to(jnp.where(valid, shard_keys, _NO_KEY), scores.shape)
  ids = jnp.broadcast_to(jnp.arange(shard.shape[0], dtype=jnp.int32) + offset,
                         scores.shape)
  scores = jnp.concatenate([best_scores, scores], axis=1)
  keys = jnp.concatenate([best_keys, keys], axis=1)
  ids = jnp.concatenate([best_ids, ids], axis=1)
  pos = _best_k(scores, keys, k)
  return tuple(jnp.take_along_axis(a, pos, axis=1) for a in (scores, ids, keys))


def _best_k_numpy(scores: np.ndarray, key_of, k: int) -> np.ndarray:
  """`_best_k` in numpy: the values above the k-th largest, then of those
  equal to it the smallest keys (linear time; `key_of(row, columns)` is
  called, and the tied keys sorted, only in rows with more ties than
  places)."""
  kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1:k]
  above, tied = scores > kth, scores == kth
  room = k - above.sum(1)
  keep = above | tied
  for row in np.flatnonzero(tied.sum(1) > room):
    columns = np.flatnonzero(tied[row])
    dropped = columns[np.argsort(key_of(row, columns), kind="stable")[room[row]:]]
    keep[row, dropped] = False
  return np.nonzero(keep)[1].reshape(len(scores), k)


def _merge_shard_numpy(queries, shard, shard_keys, offset, best_scores, best_ids,
                       best_keys, k):
  scores = np.concatenate([best_scores, queries @ shard.T], axis=1)
  pos = _best_k_numpy(scores, lambda row, columns: np.where(
      columns < k, best_keys[row, np.minimum(columns, k - 1)],
      shard_keys[np.maximum(columns - k, 0)]), k)
  running = pos < k  # the first k candidates are the running top-k
  clipped = np.minimum(pos, k - 1)
  return (np.take_along_axis(scores, pos, axis=1),
          np.where(running, np.take_along_axis(best_ids, clipped, axis=1),
                   offset + pos - k),
          np.where(running, np.take_along_axis(best_keys, clipped, axis=1),
                   shard_keys[np.maximum(pos - k, 0)]))


def search(queries: np.ndarray, shards: Iterable[np.ndarray], *, k: int,
           shard_size: int, block_size: int = 256, backend: str = "device",
           mesh: jax.sharding.Mesh | None = None,
           tie_keys: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The `k` corpus rows with the largest inner product with each query.

  Args:
    queries: float32 `[nq, d]`.
    shards: float32 `[n_i, d]` arrays, the corpus in order, each `n_i <=
      shard_size` (e.g. `Shard.load()` of each shard).
    k: results per query; at most the corpus size.
    shard_size: the largest shard (the device step's fixed shape).
    block_size: queries per step (rounded up to a multiple of the mesh's
      data-parallel size on the device).
    backend: "device" (JAX, on its default devices) or "cpu" (numpy).
    mesh: device mesh (default: all devices on the data axis).
    tie_keys: distinct non-negative ints `[corpus size]` ordering documents
      of equal score, smallest first (e.g. `trec_tie_keys`); default the
      corpus position.

  Returns:
    `(scores float32 [nq, k], indices int64 [nq, k])`, indices into the
    concatenated corpus, ordered by score descending then tie key ascending:
    the first k of that order over the whole corpus.
  """
  queries = np.asarray(queries, np.float32)
  if queries.ndim != 2 or not len(queries) or k < 1:
    raise ValueError(f"need queries [nq > 0, d] and k >= 1; got {queries.shape}, k={k}")
  nq, dim = queries.shape
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if tie_keys is not None:
    tie_keys = np.asarray(tie_keys)
    if tie_keys.ndim != 1 or (len(tie_keys) and not (
        0 <= tie_keys.min() and tie_keys.max() < _NO_KEY)):
      raise ValueError("tie_keys must be a 1-D array of ints in [0, 2**31 - 1)")
    tie_keys = tie_keys.astype(np.int32)
  device = backend == "device"
  if device:
    mesh = mesh or partitioning.make_mesh()
    block_size = -(-block_size // partitioning.data_parallel_size(mesh)) * (
        partitioning.data_parallel_size(mesh))
    rows, everywhere = (partitioning.batch_sharding(mesh, 2),
                        partitioning.replicated(mesh))
  padded = np.zeros((-(-nq // block_size) * block_size, dim), np.float32)
  padded[:nq] = queries
  blocks = [padded[i:i + block_size] for i in range(0, len(padded), block_size)]
  best = [(np.full((block_size, k), -np.inf, np.float32),
           np.full((block_size, k), -1, np.int32 if device else np.int64),
           np.full((block_size, k), _NO_KEY, np.int32))
          for _ in blocks]
  if device:
    blocks = [jax.device_put(b, rows) for b in blocks]
    best = [jax.device_put(b, rows) for b in best]

  offset = 0
  for shard in shards:
    n = len(shard)
    if not n:
      continue
    if n > shard_size or shard.ndim != 2 or shard.shape[1] != dim:
      raise ValueError(f"shard of shape {shard.shape}: expected at most "
                       f"[{shard_size}, {dim}]")
    if tie_keys is None:
      keys = np.arange(offset, offset + n, dtype=np.int32)
    else:
      keys = tie_keys[offset:offset + n]
      if len(keys) != n:
        raise ValueError(f"{len(tie_keys)} tie keys for a longer corpus")
    if device:
      fixed = np.zeros((shard_size, dim), np.float32)
      fixed[:n] = shard
      fixed_keys = np.full(shard_size, _NO_KEY, np.int32)
      fixed_keys[:n] = keys
      fixed, fixed_keys = jax.device_put((fixed, fixed_keys), everywhere)
      best = [_merge_shard(b, fixed, fixed_keys, np.int32(n), np.int32(offset), *s,
                           k=k) for b, s in zip(blocks, best)]
    else:
      shard = np.asarray(shard, np.float32)
      best = [_merge_shard_numpy(b, shard, keys, offset, *s, k)
              for b, s in zip(blocks, best)]
    offset += n
  if k > offset:
    raise ValueError(f"k={k} is more than the {offset} corpus rows")
  if tie_keys is not None and len(tie_keys) != offset:
    raise ValueError(f"{len(tie_keys)} tie keys for {offset} corpus rows")
  scores, indices, keys = (np.concatenate([np.asarray(s[i]) for s in best])[:nq]
                           for i in range(3))
  order = np.lexsort((keys, -scores), axis=1)
  return (np.take_along_axis(scores, order, axis=1),
          np.take_along_axis(indices, order, axis=1).astype(np.int64))
