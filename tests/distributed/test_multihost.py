"""Multi-host training on localhost: processes of one JAX job (CPU devices,
gloo collectives) against a single-process run of the same plan.

One single-process run on 8 devices is the reference. A two-process job is
killed (SIGKILL to one process): the other ends, a whole checkpoint stays.
A copy of the reference without its checkpoint at step 6 and with its
newest corrupted is resumed by a two-process job (from step 4, the corrupted
one moved aside), preempted (SIGTERM to one process) and rerun with
`python -m dpjax.launch`. It must end with the reference's params (up to
the order of float sums across devices) and its privacy ledger exactly.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest

from dpjax.training import checkpoints
from dpjax import launch
from dpjax.privacy import ledger as ledger_lib
from tests import numerics, test_trainer, xla_env
from tests.test_trainer import TINY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
STEPS = 8
RUN = [*TINY, f"TRAIN_STEPS = {STEPS}", "train.checkpoint_period = 2",
       "train.keep_checkpoints = 4",  # the reference's 2, 4, 6 and 8
       "train.log_period = 2",
       "train.noise_multiplier = 0.8",  # given: no calibration in each run
       "initialize.heartbeat_timeout_seconds = 10"]
HEARTBEAT = 10
TIMEOUT = 420


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """Child environment; one compilation cache shared by all the runs."""
  cache = tmp_path_factory.mktemp("jax_cache")
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
              JAX_COMPILATION_CACHE_DIR=str(cache),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def train_args(model_dir) -> list[str]:
  return ["--gin_file=quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          *[f"--gin_bindings={b}" for b in RUN]]


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
  """The uninterrupted run: one process, 8 devices, mesh {'data': 8}."""
  model_dir = tmp_path_factory.mktemp("reference")
  proc = subprocess.run(
      [sys.executable, "-m", "dpjax.train", *train_args(model_dir),
       "--gin.make_mesh.mesh_shape={'data': 8}"],
      capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT,
      env=dict(env, XLA_FLAGS=xla_env.with_devices(8)["XLA_FLAGS"]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return model_dir


def start(model_dir, logs, env) -> tuple[list[subprocess.Popen], list[str]]:
  """Two processes of one job, each logging to a file under `logs`."""
  logs.mkdir(exist_ok=True)
  paths = [str(logs / f"process{i}.log") for i in range(2)]
  outputs = [open(p, "w") for p in paths]
  procs = launch.start(2, train_args(model_dir), outputs=outputs, env=env,
                       cwd=REPO)
  for f in outputs:
    f.close()
  return procs, paths


def read(path) -> str:
  with open(path) as f:
    return f.read()


def wait_for(pattern: str, path: str, procs) -> re.Match:
  deadline = time.monotonic() + TIMEOUT
  while time.monotonic() < deadline:
    if found := re.search(pattern, read(path)):
      return found
    assert all(p.poll() is None for p in procs), read(path)[-3000:]
    time.sleep(0.2)
  raise AssertionError(f"{pattern!r} not in {path}")


def wait_for_path(path, procs, log):
  deadline = time.monotonic() + TIMEOUT
  while not os.path.exists(path):
    assert time.monotonic() < deadline, f"no {path}"
    assert all(p.poll() is None for p in procs), read(log)[-3000:]
    time.sleep(0.2)


def finish(procs, timeout=TIMEOUT) -> list[int]:
  return [p.wait(timeout=timeout) for p in procs]


def assert_same_run(model_dir, reference_dir):
  """The reference's ledger exactly; its params up to float sum order."""
  with open(os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)) as f:
    got = json.load(f)
  with open(os.path.join(reference_dir, ledger_lib.LEDGER_FILENAME)) as f:
    want = json.load(f)
  assert got == want
  assert got["steps"] == STEPS
  restored = lambda d: checkpoints.restore_params(
      checkpoints.manager(str(d), create=False), STEPS)
  # Another device layout sums in another order; Adam's m / sqrt(v) turns
  # that into ~1e-5 at coordinates whose gradients nearly cancel (seen: 8 of
  # 4096 entries off by up to 1.1e-5, and once 5.5e-5, failing an elementwise
  # rtol of 2e-4): a few coordinates, a few millionths of the update. A wrong
  # batch or noise draw changes the whole update. So compare per leaf in norm.
  differences = numerics.update_differences(
      restored(reference_dir), restored(model_dir),
      test_trainer.initial_params())
  assert max(differences) < 1e-3, differences


def test_a_killed_process_ends_the_job_and_leaves_a_readable_checkpoint(
    env, tmp_path):
  """A process dies (SIGKILL) after the first checkpoint: the other fails
  within the heartbeat timeout instead of hanging, and the newest checkpoint
  left behind is whole (resuming from one: the test below)."""
  model_dir = tmp_path / "job"
  procs, logs = start(model_dir, tmp_path / "killed", env)
  wait_for_path(model_dir / "checkpoints" / "2", procs, logs[0])
  procs[1].kill()
  killed_at = time.monotonic()
  assert procs[0].wait(timeout=HEARTBEAT + 50) != 0
  assert time.monotonic() - killed_at < HEARTBEAT + 50
  mngr = checkpoints.manager(str(model_dir), create=False)
  kept = mngr.latest_step()
  assert kept in (2, 4)
  params = checkpoints.restore_params(mngr, kept)
  assert jax.tree.structure(params) == jax.tree.structure(
      test_trainer.initial_params())


def test_a_job_resumed_past_a_corrupt_checkpoint_preempted_and_relaunched(
    reference, env, tmp_path):
  """The reference's checkpoints (one process, 8 devices) at steps 2, 4 and
  8, the newest with its array data truncated: a two-process job finds 8
  unreadable, moves it aside and resumes from the newest that reads back,
  4, saying so. SIGTERM reaches one process only: both checkpoint the same
  step and exit 0; `python -m dpjax.launch` resumes it to the end, the
  reference's end (the ledger saved with step 4 is exact: the steps after
  it, step 8 again included, are trained and saved anew)."""
  model_dir = tmp_path / "job"
  shutil.copytree(reference, model_dir)
  os.remove(model_dir / ledger_lib.LEDGER_FILENAME)  # to be written anew
  shutil.rmtree(model_dir / "checkpoints" / "6")
  for f in glob.glob(str(model_dir / "checkpoints" / str(STEPS) / "state" /
                         "d" / "*")):
    open(f, "w").close()  # truncated array data
  procs, logs = start(model_dir, tmp_path / "preempted", env)
  resumed = int(wait_for(r"resumed .* at step (\d+)", logs[0], procs)[1])
  assert resumed == 4
  out = read(logs[0])
  assert f"checkpoint at step {STEPS} is unreadable" in out
  assert (f"resuming from the previous checkpoint, step {resumed} "
          f"(not {STEPS})") in out
  assert f"resumed {model_dir} at step {resumed}" in out
  wait_for(rf"step {resumed + 2}/{STEPS}", logs[0], procs)
  procs[1].send_signal(signal.SIGTERM)
  assert finish(procs) == [0, 0], read(logs[1])[-3000:]
  assert os.listdir(model_dir / checkpoints.CORRUPT_DIRNAME) == [str(STEPS)]
  stopped = {int(re.search(r"SIGTERM: checkpointed step (\d+)", read(l))[1])
             for l in logs}
  assert len(stopped) == 1
  stopped = stopped.pop()
  assert resumed + 2 <= stopped < STEPS
  assert checkpoints.manager(str(model_dir),
                             create=False).latest_step() == stopped
  assert ledger_lib.PrivacyLedger.load(
      model_dir / ledger_lib.LEDGER_FILENAME).steps == stopped

  # Rerun with the local launcher: resumes and ends as the reference did.
  proc = subprocess.run(
      [sys.executable, "-m", "dpjax.launch", "--num_processes=2", "--",
       *train_args(model_dir)],
      capture_output=True, text=True, cwd=REPO, env=env, timeout=TIMEOUT)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert f"[0] dpjax: resumed {model_dir} at step {stopped}" in proc.stdout
  assert "[1] dpjax: process 1/2" in proc.stdout
  assert_same_run(model_dir, reference)
