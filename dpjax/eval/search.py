"""Exact top-k inner-product search, streamed over corpus embedding shards.

The corpus is never in memory whole: shards come one at a time, and each
query block keeps a running top-k that every shard's candidates are merged
into. Order: score descending, ties by corpus position ascending (so by doc
id where the corpus is sorted by id, as MSMARCO's collection is), in both
back ends:

* "device" (the default): a jitted fixed-shape step on JAX's default
  devices, an accelerator or the host: a float32 matmul at full precision
  (no TF32/bf16 passes, so it agrees with the host), `lax.top_k` over the
  shard (padded to `shard_size`, padding masked), then `lax.top_k` over
  [running, shard] candidates. `lax.top_k` puts the lower position first
  among equal values, and the running entries all come from earlier shards,
  so ties stay in corpus order. Query blocks are split over the mesh's data
  axes; the shard is replicated.
* "cpu": the same merge in numpy (`np.partition` for the k-th largest score,
  then the ties at it taken in position order). Without an accelerator XLA's
  CPU step is still about 3x faster, so this is the path for a host whose
  JAX devices are busy, and a cross-check.
"""
from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import partitioning

BACKENDS = ("device", "cpu")


@functools.partial(jax.jit, static_argnames="k")
def _merge_shard(queries, shard, num_valid, offset, best_scores, best_ids, *, k):
  scores = jnp.matmul(queries, shard.T, precision=jax.lax.Precision.HIGHEST)
  scores = jnp.where(jnp.arange(shard.shape[0]) < num_valid, scores, -jnp.inf)
  top, ids = jax.lax.top_k(scores, min(k, shard.shape[0]))
  scores = jnp.concatenate([best_scores, top], axis=1)
  ids = jnp.concatenate([best_ids, ids + offset], axis=1)
  top, pos = jax.lax.top_k(scores, k)
  return top, jnp.take_along_axis(ids, pos, axis=1)


def _top_k_numpy(scores: np.ndarray, k: int) -> np.ndarray:
  """Positions of each row's k largest, by score descending, position
  ascending: the values above the k-th largest, then as many of the values
  equal to it as fit, first positions first (linear time, then a sort of k)."""
  kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1:k]
  above, tied = scores > kth, scores == kth
  room = k - above.sum(1, keepdims=True)  # tied values that still fit
  keep = above | (tied & (np.cumsum(tied, axis=1, dtype=np.int32) <= room))
  positions = np.nonzero(keep)[1].reshape(len(scores), k)
  order = np.argsort(-np.take_along_axis(scores, positions, axis=1), axis=1,
                     kind="stable")
  return np.take_along_axis(positions, order, axis=1)


def _merge_shard_numpy(queries, shard, offset, best_scores, best_ids, k):
  scores = np.concatenate([best_scores, queries @ shard.T], axis=1)
  top = _top_k_numpy(scores, k)
  running = top < k  # the first k candidates are the running top-k
  ids = np.where(running, np.take_along_axis(best_ids, np.minimum(top, k - 1), axis=1),
                 offset + top - k)
  return np.take_along_axis(scores, top, axis=1), ids


def search(queries: np.ndarray, shards: Iterable[np.ndarray], *, k: int,
           shard_size: int, block_size: int = 256, backend: str = "device",
           mesh: jax.sharding.Mesh | None = None) -> tuple[np.ndarray, np.ndarray]:
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

  Returns:
    `(scores float32 [nq, k], indices int64 [nq, k])`, indices into the
    concatenated corpus, ordered by score descending then index ascending.
  """
  queries = np.asarray(queries, np.float32)
  if queries.ndim != 2 or not len(queries) or k < 1:
    raise ValueError(f"need queries [nq > 0, d] and k >= 1; got {queries.shape}, k={k}")
  nq, dim = queries.shape
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
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
           np.full((block_size, k), -1, np.int32 if device else np.int64))
          for _ in blocks]
  if device:
    blocks = [jax.device_put(b, rows) for b in blocks]
    best = [jax.device_put(b, rows) for b in best]

  offset = 0
  for shard in shards:
    n = len(shard)
    if n > shard_size or shard.ndim != 2 or shard.shape[1] != dim:
      raise ValueError(f"shard of shape {shard.shape}: expected at most "
                       f"[{shard_size}, {dim}]")
    if device:
      fixed = np.zeros((shard_size, dim), np.float32)
      fixed[:n] = shard
      fixed = jax.device_put(fixed, everywhere)
      best = [_merge_shard(b, fixed, np.int32(n), np.int32(offset), *s, k=k)
              for b, s in zip(blocks, best)]
    else:
      shard = np.asarray(shard, np.float32)
      best = [_merge_shard_numpy(b, shard, offset, *s, k)
              for b, s in zip(blocks, best)]
    offset += n
  if k > offset:
    raise ValueError(f"k={k} is more than the {offset} corpus rows")
  scores = np.concatenate([np.asarray(s) for s, _ in best])[:nq]
  indices = np.concatenate([np.asarray(i) for _, i in best])[:nq]
  return scores, indices.astype(np.int64)
