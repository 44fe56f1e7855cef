"""`python -m dpjax.launch`: a multi-host job as N processes on this machine.

  python -m dpjax.launch --num_processes=2 [--devices_per_process=1] -- \\
      --gin_file=gin/quickstart.gin --gin.MODEL_DIR=runs/quickstart [...]

For trying and testing multi-host runs on one machine, on CPU: starts N
`python -m dpjax.train` processes (the arguments after `--`) that join one JAX
job through dpjax.training.distributed's environment (a free localhost port for the
coordinator), each with `devices_per_process` CPU devices. Their output lines
are prefixed with `[i] `. SIGTERM is passed on to all of them (a preemption:
they checkpoint the same step and exit 0), and so is SIGINT. The exit status
is the first non-zero one, or 0; a process still running a grace period
after another failed is killed.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from dpjax.training import distributed

GRACE_SECONDS = 90  # > distributed.initialize's heartbeat timeout


def free_port() -> int:
  """A TCP port of localhost that is free when asked (not reserved)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, port: int,
                devices_per_process: int, base: dict | None = None) -> dict:
  """The environment of process `process_id` of a local job."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update({
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": " ".join(flags + [
          f"--xla_force_host_platform_device_count={devices_per_process}"]),
      distributed.ENV_COORDINATOR: f"localhost:{port}",
      distributed.ENV_NUM_PROCESSES: str(num_processes),
      distributed.ENV_PROCESS_ID: str(process_id),
      "PYTHONUNBUFFERED": "1",
  })
  return env


def start(num_processes: int, train_args: Sequence[str], *,
          devices_per_process: int = 1,
          outputs: Sequence[IO] | None = None,
          env: dict | None = None, cwd: str | None = None
          ) -> list[subprocess.Popen]:
  """Starts the processes of one local job running `python -m dpjax.train
  *train_args`; their stdout+stderr go to `outputs[i]` (default: pipes)."""
  port = free_port()
  return [
      subprocess.Popen(
          [sys.executable, "-m", "dpjax.train", *train_args],
          env=process_env(i, num_processes, port, devices_per_process, env),
          cwd=cwd, stdout=outputs[i] if outputs else subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True)
      for i in range(num_processes)]


def wait(procs: Sequence[subprocess.Popen],
         grace_seconds: float = GRACE_SECONDS) -> int:
  """Waits for all; the first non-zero status (or 0). Once one has failed,
  those still running after `grace_seconds` are killed."""
  failed_at = None
  while any(p.poll() is None for p in procs):
    if failed_at is None and any(p.poll() for p in procs):
      failed_at = time.monotonic()
    if failed_at is not None and time.monotonic() - failed_at > grace_seconds:
      for p in procs:
        if p.poll() is None:
          p.kill()
    time.sleep(0.2)
  return next((p.returncode for p in procs if p.returncode), 0)


def _prefix(i: int, stream: IO) -> None:
  for line in stream:
    sys.stdout.write(f"[{i}] {line}")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m dpjax.launch`; returns the first non-zero status, or 0."""
  argv = list(sys.argv[1:] if argv is None else argv)
  ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
      if "--" in argv else (argv, [])
  parser = argparse.ArgumentParser(
      description="Runs python -m dpjax.train as N local CPU processes of one "
                  "multi-host job (arguments after --).")
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--devices_per_process", type=int, default=1)
  args = parser.parse_args(ours)
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num_processes and --devices_per_process must be >= 1")
  procs = start(args.num_processes, train_args,
                devices_per_process=args.devices_per_process)
  readers = [threading.Thread(target=_prefix, args=(i, p.stdout), daemon=True)
             for i, p in enumerate(procs)]
  for r in readers:
    r.start()
  forward = lambda signum, _: [p.send_signal(signum) for p in procs
                               if p.poll() is None]
  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  status = wait(procs)
  for r in readers:
    r.join()
  return status


if __name__ == "__main__":
  sys.exit(main())
