"""Many small GPT-2 teachers, trained a group at a time with `jax.vmap`.

A group of G teachers is one pytree of stacked params `[G, ...]` (and stacked
optimizer states). One jitted function trains the whole group: `lax.scan`
over steps, `jax.vmap` over teachers, each teacher on its own fixed-shape
batches from its own partition. The G axis is sharded over a 1-D device mesh
(axis 'teachers'), so each device trains G / devices teachers with no
communication. Training is plain (non-private) optax: privacy comes from the
noisy aggregation of the teachers' answers, not from their training.

Data streams (`batch_schedule`): a teacher's epoch is a permutation of its
examples (seeded by (seed, teacher, epoch)), cut into `S = ceil(max teacher
size / B)` batches of B rows; a smaller partition is padded with masked rows
(index -1, loss weight 0). S is the same for every teacher, so a teacher's
stream does not depend on which group it is in. A step without any real row
leaves that teacher's params and optimizer state unchanged. The loss is the
mean token cross-entropy over the batch's real target tokens.

After training, `group_top_k` runs the group on the pseudo-data and keeps
each teacher's `top_k` next-token probabilities at every position;
`train_and_cache` writes them per group (`dpjax.pipelines.seqpate.cache`) and drops
the params before the next group.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dpjax.training import partitioning
from dpjax.models import gpt2, losses
from dpjax.pipelines.seqpate import cache as cache_lib

PyTree = Any
TEACHER_AXIS = "teachers"


def teacher_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh over `devices` (default: all) whose axis holds teachers."""
  return partitioning.make_mesh({TEACHER_AXIS: -1}, devices)


def shard_teachers(tree: PyTree, mesh: Mesh) -> PyTree:
  """Places every leaf with its leading (teacher) axis split over the mesh."""
  sharding = NamedSharding(mesh, P(TEACHER_AXIS))
  return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def steps_per_epoch(assignment: np.ndarray, num_teachers: int,
                    batch_size: int) -> int:
  """Batches per epoch: enough for the largest partition."""
  return math.ceil(np.bincount(assignment, minlength=num_teachers).max()
                   / batch_size)


def batch_schedule(assignment: np.ndarray, teachers: Sequence[int], *,
                   batch_size: int, epochs: int, seed: int,
                   num_teachers: int) -> np.ndarray:
  """`[epochs * S, G, batch_size]` int32 example indices (-1 = padding).

  Column g is the stream of teacher `teachers[g]`; a teacher id of -1 (a
  padding slot of the last group) gets only padding.
  """
  per_epoch = steps_per_epoch(assignment, num_teachers, batch_size)
  slots = per_epoch * batch_size
  order = np.argsort(assignment, kind="stable")
  starts = np.searchsorted(assignment[order], np.arange(num_teachers + 1))
  out = np.full((epochs, per_epoch, len(teachers), batch_size), -1, np.int32)
  for g, t in enumerate(teachers):
    if t < 0:
      continue
    members = order[starts[t]:starts[t + 1]]
    for e in range(epochs):
      perm = np.random.default_rng((seed, t, e)).permutation(members)
      epoch = np.full(slots, -1, np.int32)
      epoch[:len(perm)] = perm
      out[e, :, g] = epoch.reshape(per_epoch, batch_size)
  return out.reshape(epochs * per_epoch, len(teachers), batch_size)


def make_group_train(config: gpt2.GPT2Config,
                     optimizer: optax.GradientTransformation) -> Callable:
  """`train(params, opt_state, tokens, loss_weights, schedule, keys, step0)`.

  params, opt_state: stacked `[G, ...]`; tokens, loss_weights: the whole
  private set `[n, L]` (replicated; rows are gathered on device); schedule:
  `[S, G, B]` from `batch_schedule`; keys: `[G]` per-teacher dropout keys;
  step0: the global index of the schedule's first step (dropout is keyed by
  (teacher key, step)). Returns `(params, opt_state, losses [S, G])`.
  Jitted once per shape; params and optimizer state are donated.
  """
  model = gpt2.GPT2(config)
  dropout = config.dropout_rate > 0

  def loss_fn(params, tokens, weights, rng):
    logits = model.apply({"params": params}, tokens, enable_dropout=dropout,
                         rngs={"dropout": rng} if dropout else {})
    xent = losses.token_cross_entropy(logits[:, :-1], tokens[:, 1:])
    weights = weights[:, 1:]
    count = weights.sum()
    return (xent * weights).sum() / jnp.maximum(count, 1.0), count

  def teacher_step(params, opt_state, tokens, weights, rng):
    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, tokens, weights, rng)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(count > 0, new, old)
    return (jax.tree.map(keep, new_params, params),
            jax.tree.map(keep, new_opt_state, opt_state), loss)

  group_step = jax.vmap(teacher_step)

  def train(params, opt_state, tokens, loss_weights, schedule, keys, step0):
    def body(carry, xs):
      params, opt_state = carry
      index, step = xs
      rows = jnp.maximum(index, 0)
      weights = loss_weights[rows] * (index >= 0)[..., None]
      rngs = jax.vmap(jax.random.fold_in, (0, None))(keys, step)
      params, opt_state, loss = group_step(params, opt_state, tokens[rows],
                                           weights, rngs)
      return (params, opt_state), loss

    steps = step0 + jnp.arange(schedule.shape[0])
    (params, opt_state), step_losses = jax.lax.scan(
        body, (params, opt_state), (schedule, steps))
    return params, opt_state, step_losses

  return jax.jit(train, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=None)
def _adam_group_train(config: gpt2.GPT2Config, learning_rate: float) -> Callable:
  """`make_group_train` with Adam at `learning_rate`, cached per arguments,
  so the teachers of every table (seed, partition) of one configuration share
  the compilation."""
  return make_group_train(config, optax.adam(learning_rate))


@functools.lru_cache(maxsize=None)
def make_group_top_k(config: gpt2.GPT2Config, top_k: int) -> Callable:
  """`fn(params [G, ...], tokens [P, L]) -> (ids, probs)`, both `[G, P, L,
  top_k]`: each teacher's most likely next tokens at every position. Cached
  per arguments, so the groups of every table share the compilation."""
  if not 1 <= top_k <= config.vocab_size:
    raise ValueError(f"top_k must be in [1, {config.vocab_size}], got {top_k}.")
  model = gpt2.GPT2(config)

  def one(params, tokens):
    logits = model.apply({"params": params}, tokens)
    probs, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32)),
                               top_k)
    return ids.astype(jnp.int32), probs

  return jax.jit(jax.vmap(one, in_axes=(0, None)))


def group_top_k(top_k_fn: Callable, params: PyTree, tokens: np.ndarray,
                chunk: int) -> tuple[np.ndarray, np.ndarray]:
  """Runs `make_group_top_k`'s function over the pseudo-data `[P, L]` in
  chunks of `chunk` sentences (the last one padded, so it compiles once)."""
  n = tokens.shape[0]
  pad = -n % chunk
  padded = np.concatenate([tokens, np.repeat(tokens[-1:], pad, 0)])
  ids, probs = [], []
  for start in range(0, n + pad, chunk):
    i, p = top_k_fn(params, padded[start:start + chunk])
    ids.append(np.asarray(i))
    probs.append(np.asarray(p))
  return (np.concatenate(ids, 1)[:, :n], np.concatenate(probs, 1)[:, :n])


def stack(params: PyTree, copies: int) -> PyTree:
  """`copies` copies of `params` stacked on a new leading axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (copies, *x.shape)),
                      params)


@dataclasses.dataclass(frozen=True)
class TeacherSetup:
  """How the teachers train: all start from `init_params` (the pre-trained
  model, as in the paper), `epochs` passes over their own partitions."""
  batch_size: int
  epochs: int
  learning_rate: float
  group_size: int
  seed: int = 0
  top_k: int = 200
  inference_chunk: int = 64


def train_and_cache(config: gpt2.GPT2Config, init_params: PyTree,
                    tokens: np.ndarray, loss_weights: np.ndarray,
                    assignment: np.ndarray, pseudo_tokens: np.ndarray,
                    cache_dir: str, setup: TeacherSetup, *,
                    mesh: Mesh | None = None,
                    optimizer: optax.GradientTransformation | None = None,
                    log: Callable[[str], None] = print) -> list[str]:
  """Trains all teachers group by group; after each group writes its top-k
  cache file and drops its params. Groups whose file exists are skipped
  (resume). Returns the group files.

  Args:
    config: teacher GPT-2 config (dropout as configured).
    init_params: the params every teacher starts from.
    tokens, loss_weights: the private set, `[n, L]`.
    assignment: `[n]` teacher of each example (`dpjax.pipelines.seqpate.partition`).
    pseudo_tokens: `[P, L']` pseudo-data the teachers answer on.
    cache_dir: where the group files go.
    setup: batch size, epochs, learning rate, group size, seed, top_k.
    mesh: 1-D mesh over which the teacher axis is split (default: all
      devices); `setup.group_size` must be a multiple of its size.
    optimizer: default Adam at `setup.learning_rate`.
    log: receives one line per trained group.
  """
  mesh = mesh or teacher_mesh()
  num_teachers = int(assignment.max()) + 1
  group = setup.group_size
  if group % mesh.size:
    raise ValueError(f"group_size {group} is not a multiple of the "
                     f"{mesh.size} devices of the teacher mesh.")
  if optimizer is None:
    optimizer = optax.adam(setup.learning_rate)
    train = _adam_group_train(config, setup.learning_rate)
  else:
    train = make_group_train(config, optimizer)
  top_k = make_group_top_k(config, setup.top_k)
  replicated = partitioning.replicated(mesh)
  data = jax.device_put((jnp.asarray(tokens, jnp.int32),
                         jnp.asarray(loss_weights, jnp.float32)), replicated)
  pseudo_fp = cache_lib.fingerprint(pseudo_tokens)
  root = jax.random.key(setup.seed)
  paths = []
  for g, first in enumerate(range(0, num_teachers, group)):
    path = cache_lib.group_path(cache_dir, g)
    paths.append(path)
    if os.path.exists(path):
      continue
    real = list(range(first, min(first + group, num_teachers)))
    slots = real + [-1] * (group - len(real))  # padding teachers: no data
    params = shard_teachers(stack(init_params, group), mesh)
    opt_state = shard_teachers(jax.vmap(optimizer.init)(params), mesh)
    keys = shard_teachers(jax.vmap(lambda t: jax.random.fold_in(root, t))(
        jnp.asarray(slots)), mesh)
    schedule = batch_schedule(assignment, slots, batch_size=setup.batch_size,
                              epochs=setup.epochs, seed=setup.seed,
                              num_teachers=num_teachers)
    schedule = jax.device_put(schedule,
                              NamedSharding(mesh, P(None, TEACHER_AXIS)))
    params, opt_state, step_losses = train(params, opt_state, *data, schedule,
                                           keys, 0)
    ids, probs = group_top_k(top_k, params, np.asarray(pseudo_tokens),
                             setup.inference_chunk)
    del params, opt_state
    cache_lib.write_group(cache_dir, g, real, ids[:len(real)],
                          probs[:len(real)], pseudo_fingerprint=pseudo_fp,
                          vocab_size=config.vocab_size)
    per_epoch = len(schedule) // setup.epochs
    last_epoch = np.asarray(step_losses)[-per_epoch:, :len(real)]
    log(f"teacher group {g}: teachers {real[0]}..{real[-1]}, last-epoch "
        f"loss {last_epoch[last_epoch > 0].mean():.4f}")
  return paths
