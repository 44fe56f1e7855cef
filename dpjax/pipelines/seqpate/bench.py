"""`python -m dpjax.pipelines.seqpate.bench`: SeqPATE teacher-training throughput, one
JSON line.

  python -m dpjax.pipelines.seqpate.bench --model=gpt2_small --teachers=8 --seq=40 \\
      --batch=8 --steps=20

Times `--steps` training steps of `--teachers` GPT-2 teachers (random tokens,
each teacher its own rows, dropout off, Adam) two ways:

  vmapped     one `teachers.make_group_train` call for the whole group:
              stacked params, `jax.vmap` over teachers, the teacher axis
              sharded over all devices;
  sequential  the same function for a group of one, called once per teacher
              (one device): the one-model-at-a-time baseline.

Reported per way: the median wall time over `--repeats` timed runs (after
one untimed run that compiles), and teacher tokens/s = teachers x steps x
batch x (seq - 1) target tokens / time; and the speedup of vmapped over
sequential.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Sequence

import jax
import numpy as np
import optax

from dpjax.bench import step as dpjax_bench
from dpjax.pipelines.seqpate import teachers


def _time_runs(train, params, opt_state, data, schedule, keys,
               repeats: int) -> list[float]:
  times = []
  for i in range(repeats + 1):
    start = time.perf_counter()
    params, opt_state, losses = train(params, opt_state, *data, schedule, keys,
                                      0)
    jax.block_until_ready(losses)
    if i:  # the first run compiles
      times.append(time.perf_counter() - start)
  return times


def run(args: argparse.Namespace) -> dict:
  """Times the teachers' training vmapped as one group and one at a time.

  Returns:
    The JSON line's fields: the settings, the median times, teacher tokens/s
    of each way and the speedup.
  """
  config = dpjax_bench.model_config(args.model, dtype=args.dtype,
                                    vocab_size=args.vocab)
  g, b, length = args.teachers, args.batch, args.seq
  mesh = teachers.teacher_mesh()
  if g % mesh.size:
    raise dpjax_bench.Unavailable(f"--teachers={g} is not a multiple of the "
                                  f"{mesh.size} devices")
  rng = np.random.default_rng(args.seed)
  n = g * b * args.steps  # each teacher sees new rows at every step
  tokens = rng.integers(0, config.vocab_size, (n, length), dtype=np.int32)
  weights = np.ones((n, length), np.float32)
  assignment = np.arange(n, dtype=np.int32) % g
  schedule = teachers.batch_schedule(assignment, list(range(g)), batch_size=b,
                                     epochs=1, seed=args.seed, num_teachers=g)
  params, _ = teachers.gpt2.init_params(config, jax.random.key(args.seed),
                                        max_length=length)
  optimizer = optax.adam(args.learning_rate)
  train = teachers.make_group_train(config, optimizer)
  key = jax.random.key(args.seed)
  data = (tokens, weights)

  def group_times(members: list[int], shard: bool) -> list[float]:
    stacked = teachers.stack(params, len(members))
    opt_state = jax.vmap(optimizer.init)(stacked)
    keys = jax.vmap(lambda t: jax.random.fold_in(key, t))(np.asarray(members))
    if shard:
      stacked, opt_state, keys = (teachers.shard_teachers(x, mesh)
                                  for x in (stacked, opt_state, keys))
    return _time_runs(train, stacked, opt_state, data,
                      schedule[:, members], keys, args.repeats)

  vmapped = statistics.median(group_times(list(range(g)), shard=True))
  sequential = statistics.median(
      [sum(ts) for ts in zip(*(group_times([t], shard=False)
                               for t in range(g)))])
  target_tokens = g * args.steps * b * (length - 1)
  return dict(
      model=args.model, dtype=args.dtype, teachers=g, batch=b, seq=length,
      steps=args.steps, repeats=args.repeats,
      params_per_teacher=teachers.gpt2.param_count(params),
      vmapped_s=round(vmapped, 4), sequential_s=round(sequential, 4),
      vmapped_teacher_tokens_per_s=round(target_tokens / vmapped, 1),
      sequential_teacher_tokens_per_s=round(target_tokens / sequential, 1),
      speedup=round(sequential / vmapped, 3))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parses the flags of `python -m dpjax.pipelines.seqpate.bench`."""
  p = argparse.ArgumentParser(
      prog="python -m dpjax.pipelines.seqpate.bench",
      description="Teacher-training throughput: vmapped group vs one at a "
                  "time; one JSON line.")
  p.add_argument("--model", default="gpt2_tiny", help="a gin/models gpt2_*")
  p.add_argument("--teachers", type=int, default=8, help="group size G")
  p.add_argument("--seq", type=int, default=40, help="tokens per example")
  p.add_argument("--batch", type=int, default=8, help="examples per teacher "
                 "per step")
  p.add_argument("--steps", type=int, default=20, help="steps per run")
  p.add_argument("--repeats", type=int, default=3, help="timed runs")
  p.add_argument("--dtype", choices=("bfloat16", "float32"),
                 default="float32", help="compute dtype")
  p.add_argument("--vocab", type=int, default=50257,
                 help="vocabulary size (tiny gin files leave it to the task)")
  p.add_argument("--learning_rate", type=float, default=1e-4)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if min(args.teachers, args.steps, args.repeats, args.batch) < 1 or (
      args.seq < 2):
    p.error("--teachers, --steps, --repeats, --batch must be >= 1, --seq >= 2")
  if not args.model.startswith("gpt2_"):
    p.error("--model must be a GPT-2 gin file (gpt2_*)")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m dpjax.pipelines.seqpate.bench`; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  context = dpjax_bench.machine_context("dpjax.pipelines.seqpate.bench", argv)
  try:
    result, status = run(args), 0
  except dpjax_bench.Unavailable as e:
    result, status = {"error": str(e)}, 1
  print(json.dumps({**result, **context}), flush=True)
  return status


if __name__ == "__main__":
  sys.exit(main())
