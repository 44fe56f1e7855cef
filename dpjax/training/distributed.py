"""Multi-host runs on JAX's multi-controller runtime.

Every host (or every GPU) runs the same `python -m dpjax.train`. `initialize()`
joins the processes into one JAX job before any other JAX call; from then on
`jax.devices()` lists the devices of all hosts, the mesh spans them, and each
jitted step runs SPMD over all of them, its collectives crossing hosts.

What differs from a single-process run is only where data enters and who
speaks:

* Data: every process computes the same global sample (a pure function of
  (secret, step); process 0 hands every process the run secret,
  `from_primary`) and reads only the rows its own devices hold
  (`global_rows`), so each sampled example is read by exactly one host and
  the global batch is the single-process one.
* Output: process 0 alone writes the console, TensorBoard summaries, the
  privacy ledger file and config.gin; all processes write their shards of
  the orbax checkpoints.
* Preemption: SIGTERM reaching any process stops all of them at the same
  step boundary (`preemption_watch`).
* Failure: a process that dies makes the others fail within
  `heartbeat_timeout_seconds` (JAX's coordination service), never hang.

Nothing here imports TensorFlow.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from dpjax import errors

ENV_COORDINATOR = "DPJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "DPJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "DPJAX_PROCESS_ID"
ENV_CLUSTER_DETECTION = "DPJAX_CLUSTER_DETECTION"


def _setting(value, env: str, cast=str):
  if value is None and os.environ.get(env):
    value = os.environ[env]
  return None if value is None else cast(value)


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None, *,
               cluster_detection: str | None = None,
               heartbeat_timeout_seconds: int = 30,
               initialization_timeout_seconds: int = 300) -> None:
  """Joins this process to a multi-host JAX job, or does nothing.

  Call it before any other JAX use. Sources, first match wins:
    * explicit: `coordinator_address` ('host:port' of process 0),
      `num_processes` and `process_id`, from gin or the environment
      (DPJAX_COORDINATOR_ADDRESS, DPJAX_NUM_PROCESSES, DPJAX_PROCESS_ID);
    * `cluster_detection` (or DPJAX_CLUSTER_DETECTION): 'auto' lets JAX find
      the cluster (Cloud TPU pod metadata, SLURM, Open MPI); a JAX method name
      ('tpu', 'slurm', 'ompi', 'mpi4py', ...) forces that one;
    * otherwise a single process: nothing to do.

  A process that stops sending heartbeats for `heartbeat_timeout_seconds`
  fails the whole job; `initialization_timeout_seconds` bounds the wait for
  the others to join. On CPU, cross-process collectives use gloo.
  """
  if jax.distributed.is_initialized():
    return
  address = _setting(coordinator_address, ENV_COORDINATOR)
  count = _setting(num_processes, ENV_NUM_PROCESSES, int)
  index = _setting(process_id, ENV_PROCESS_ID, int)
  detection = _setting(cluster_detection, ENV_CLUSTER_DETECTION)
  explicit = {"coordinator_address": address, "num_processes": count,
              "process_id": index}
  given = {k for k, v in explicit.items() if v is not None}
  if given and given != set(explicit):
    raise errors.UsageError(
        f"multi-host: {sorted(given)} set but {sorted(set(explicit) - given)} "
        f"missing; give all three (gin initialize.* or {ENV_COORDINATOR}, "
        f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})")
  if not given and detection is None:
    return
  if count == 1 and index == 0:
    return
  if jax.config.jax_cpu_collectives_implementation in (None, "none"):
    # CPU processes need a collectives backend to talk (the default in
    # recent JAX; 'mpi' stays if chosen).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # SIGTERM stays ours (`preemption_watch`): JAX's preemption notifier would
  # take it, and its sync point, agreed on call counts, is never reached by
  # a run resumed at step s > 0 that is signalled before its first step.
  jax.config.update("jax_enable_preemption_service", False)
  timeouts = dict(heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                  initialization_timeout=initialization_timeout_seconds)
  if given:
    jax.distributed.initialize(address, count, index, **timeouts)
  else:
    jax.distributed.initialize(
        cluster_detection_method=None if detection == "auto" else detection,
        **timeouts)
  print(f"dpjax: process {jax.process_index()}/{jax.process_count()}: "
        f"{jax.local_device_count()} local devices, {jax.device_count()} "
        f"global ({jax.devices()[0].platform})", flush=True)


def is_primary() -> bool:
  """Process 0: the one that writes the console, summaries and ledger file."""
  return jax.process_index() == 0


def all_processes(value: int) -> np.ndarray:
  """`value` of every process, in process order (an allgather)."""
  if jax.process_count() == 1:
    return np.asarray([value])
  return np.asarray(multihost_utils.process_allgather(np.int32(value)))


def sync(name: str) -> None:
  """Waits until every process reaches the barrier `name`."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def from_primary(data: bytes) -> bytes:
  """Process 0's `data` on every process (the same length on each)."""
  if jax.process_count() == 1:
    return data
  got = multihost_utils.broadcast_one_to_all(np.frombuffer(data, np.uint8))
  return np.asarray(got).astype(np.uint8).tobytes()


def global_array(host: np.ndarray, sharding) -> jax.Array:
  """A host array that every process holds identically, as one global
  jax.Array: each process places only the slices its own devices hold."""
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: host[index])


def global_rows(arrays: Mapping[str, np.ndarray], idx: np.ndarray,
                sharding) -> dict[str, jax.Array]:
  """`{k: arrays[k][idx]}` as global jax.Arrays laid out by `sharding`, each
  process reading only the rows of `idx` that its own devices hold.

  `idx` (e.g. [K, m] example indices) is the leading shape of each result
  and must be the same on every process; `sharding` must fit every result.
  """
  lead = idx.ndim

  def place(rows: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(
        idx.shape + rows.shape[1:], sharding,
        lambda index: rows[idx[index[:lead]]][(slice(None),) * lead +
                                              tuple(index[lead:])])

  return {k: place(v) for k, v in arrays.items()}


@contextlib.contextmanager
def preemption_watch() -> Iterator[Callable[[], bool]]:
  """Yields `stop() -> bool`, for every process to call at every step
  boundary: True on all of them at the first boundary after SIGTERM reached
  any of them, so all checkpoint the same step and a rerun resumes exactly.

  A SIGTERM handler sets a local flag; with several processes the flags are
  allgathered at each call (a few-byte collective, ~1.5 ms on CPU). Signal
  handlers can only be installed from the main thread; elsewhere SIGTERM
  keeps its default action.
  """
  flag = threading.Event()
  stop = lambda: bool(all_processes(flag.is_set()).any())
  if threading.current_thread() is not threading.main_thread():
    yield stop
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: flag.set())
  try:
    yield stop
  finally:
    signal.signal(signal.SIGTERM, previous)
