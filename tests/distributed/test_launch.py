"""Multi-host setup and launchers, without starting a job: settings,
the local launcher's failure handling, and the TPU/SLURM scripts' commands."""
from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import time

import jax
import pytest

from dpjax.training import distributed
from dpjax import errors, launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TRAIN_ARGS = ["--gin_file=gin/msmarco_t5_xl_eps3.gin",
              "--gin.MODEL_DIR=gs://bucket/runs/xl eps3"]


def test_single_process_needs_no_setup(monkeypatch):
  for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
              distributed.ENV_PROCESS_ID, distributed.ENV_CLUSTER_DETECTION):
    monkeypatch.delenv(var, raising=False)
  distributed.initialize()
  distributed.initialize("localhost:1234", 1, 0)
  assert not jax.distributed.is_initialized()


def test_partial_explicit_settings_are_refused(monkeypatch):
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  with pytest.raises(errors.UsageError,
                     match=r"\['num_processes'\] set but "
                           r"\['coordinator_address', 'process_id'\] missing"):
    distributed.initialize()
  with pytest.raises(errors.UsageError, match=r"\['process_id'\] missing"):
    distributed.initialize(coordinator_address="localhost:1234")
  assert not jax.distributed.is_initialized()


def test_process_env_sets_the_coordinator_and_device_count():
  env = launch.process_env(1, 4, 5555, 2, base={
      "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"})
  assert env[distributed.ENV_COORDINATOR] == "localhost:5555"
  assert (env[distributed.ENV_NUM_PROCESSES], env[distributed.ENV_PROCESS_ID]
          ) == ("4", "1")
  assert env["XLA_FLAGS"].split() == [
      "--xla_foo=1", "--xla_force_host_platform_device_count=2"]


def test_wait_returns_the_failure_and_ends_the_others():
  procs = [subprocess.Popen([sys.executable, "-c", code]) for code in
           ("import sys; sys.exit(3)", "import time; time.sleep(120)")]
  start = time.monotonic()
  assert launch.wait(procs, grace_seconds=1) == 3
  assert time.monotonic() - start < 30
  assert procs[1].returncode == -9  # killed after the grace period


def test_tpu_pod_dry_run_prints_create_install_and_run():
  proc = subprocess.run(
      ["bash", "launch/tpu_pod.sh", "--name=pod", "--zone=us-central2-b",
       "--accelerator_type=v4-32", "--spot", "--dry-run", "--", *TRAIN_ARGS],
      capture_output=True, text=True, cwd=REPO, timeout=60)
  assert proc.returncode == 0, proc.stderr
  commands = [shlex.split(line[2:]) for line in proc.stdout.splitlines()
              if line.startswith("+ ")]
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  create, archive, scp, install, train = commands
  assert create == [*tpu, "create", "pod", "--zone=us-central2-b",
                    "--accelerator-type=v4-32",
                    "--version=tpu-ubuntu2204-base", "--spot"]
  assert archive[0] == "git" and archive[-1] == "HEAD"
  assert scp[:5] == [*tpu, "scp"] and "--worker=all" in scp
  assert install[:6] == [*tpu, "ssh", "pod"]
  assert "--worker=all" in install and "pip install -q -e ." in install[-1]
  assert train[:6] == [*tpu, "ssh", "pod"] and "--worker=all" in train
  remote = train[-1].removeprefix("--command=")
  assert "DPJAX_CLUSTER_DETECTION=auto python3 -m dpjax.train " in remote
  assert shlex.split(remote.split("python3 -m dpjax.train", 1)[1]
                     .split("2>&1")[0]) == TRAIN_ARGS  # quoted for the shell


def test_tpu_pod_requires_name_zone_and_train_flags():
  proc = subprocess.run(["bash", "launch/tpu_pod.sh", "--zone=z", "--", "x"],
                        capture_output=True, text=True, cwd=REPO, timeout=60)
  assert proc.returncode == 2 and "--name and --zone are required" in proc.stderr


def _fake_srun(tmp_path):
  fake = tmp_path / "srun"  # records what sbatch's srun would start
  fake.write_text('#!/bin/sh\necho "DETECTION=$DPJAX_CLUSTER_DETECTION"\n'
                  'for a in "$@"; do echo "ARG=$a"; done\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)


def _sbatch(tmp_path, **env):
  return subprocess.run(
      ["bash", os.path.join(REPO, "launch", "slurm.sbatch"), *TRAIN_ARGS], capture_output=True,
      text=True, cwd=tmp_path, timeout=120,
      env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}",
               SLURM_SUBMIT_DIR=REPO, **env))


def test_slurm_script_refuses_a_node_whose_jax_sees_no_gpu(tmp_path):
  _fake_srun(tmp_path)
  proc = _sbatch(tmp_path, JAX_PLATFORMS="cpu")  # this machine: no GPU
  assert proc.returncode == 2
  assert "jax sees no GPU" in proc.stderr and ".[cuda12]" in proc.stderr
  assert proc.stdout == ""  # srun never started


def test_slurm_script_runs_one_train_per_task_with_slurm_detection(tmp_path):
  _fake_srun(tmp_path)
  python = tmp_path / "gpu_python"  # passes the GPU check, as on a GPU node
  python.write_text("#!/bin/sh\nexit 0\n")
  python.chmod(python.stat().st_mode | stat.S_IEXEC)
  proc = _sbatch(tmp_path, DPJAX_PYTHON=str(python))
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0] == "DETECTION=slurm"
  args = [line[len("ARG="):] for line in lines[1:]]
  assert args[:3] == ["--kill-on-bad-exit=1", "--label", str(python)]
  assert args[3:] == ["-m", "dpjax.train", *TRAIN_ARGS]
