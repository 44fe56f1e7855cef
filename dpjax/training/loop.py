"""The training loop: a step function, then callbacks (jax_privacy's `fit`).

`fit` runs steps [start, end) of a state through `step_fn` and hands each
finished step to the callbacks, which do everything else a run needs:
reporting (`Reporter`: windowed metrics, ε, the console line, TensorBoard),
evaluation (`Evaluator`) and checkpoints (`Checkpointer`). A stop request
(preemption) ends the loop at a step boundary after the callbacks have seen
that step as the final one, so the checkpointer saves it.

The loop knows nothing of privacy: the step function records its releases
in the ledger, and the callbacks only read.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from dpjax.training import checkpoints, reporting
from dpjax.privacy import ledger as ledger_lib


class StepOutput(NamedTuple):
  """What one step did: `dp` (a release, else a public step), the metrics
  it computed on device (one dict per accumulate call of a DP step, one for
  a public step; fetched only when reported) and its real tokens."""
  dp: bool
  metrics: list[dict]
  tokens: int


# (steps done, state, the step's output, whether it is the loop's last step)
Callback = Callable[[int, Any, StepOutput, bool], None]


def fit(state, step_fn: Callable[[Any, int], tuple[Any, StepOutput]], *,
        start_step: int, end_step: int, callbacks: Sequence[Callback] = (),
        should_stop: Callable[[], bool] = lambda: False) -> tuple[Any, int]:
  """Runs steps `start_step`..`end_step - 1`; returns (state, steps done).

  `should_stop` is asked after every step (e.g. a SIGTERM agreed across
  hosts); when it says yes, that step is the last one the callbacks see.
  """
  done = start_step
  for step in range(start_step, end_step):
    state, output = step_fn(state, step)
    done = step + 1
    stop = should_stop()
    for callback in callbacks:
      callback(done, state, output, done == end_step or stop)
    if stop:
      break
  return state, done


class Reporter:
  """Every `period` steps (and at the last): the window's metrics, ε spent,
  the learning rate, DP and public step counts -> TensorBoard `train/` and
  the console progress line. `last` holds the latest report."""

  def __init__(self, *, period: int, ledger: ledger_lib.PrivacyLedger,
               summaries: reporting.Summaries, progress: reporting.Progress,
               target_epsilon: float, schedule, mixed: bool):
    self.period, self.ledger = period, ledger
    self.summaries, self.progress = summaries, progress
    self.target_epsilon, self.schedule, self.mixed = (target_epsilon, schedule,
                                                      mixed)
    self.last: dict = {}
    self._reset()

  def _reset(self):
    self._dp, self._public, self._dp_steps, self._tokens = [], [], 0, 0
    self._start = time.perf_counter()

  def __call__(self, step: int, state, output: StepOutput, final: bool):
    del state
    (self._dp if output.dp else self._public).extend(output.metrics)
    self._dp_steps += output.dp
    self._tokens += output.tokens
    if step % self.period and not final:
      return
    last = window_metrics(jax.device_get(self._dp),
                          jax.device_get(self._public), self._dp_steps,
                          self._tokens, time.perf_counter() - self._start)
    last["epsilon"] = self.ledger.epsilon_spent()
    last["learning_rate"] = float(self.schedule(step) if callable(self.schedule)
                                  else self.schedule)
    last["dp_steps"], last["public_steps"] = (self.ledger.steps,
                                              step - self.ledger.steps)
    self.summaries.scalars("train", step, last)
    self.progress.report(
        step, loss=last.get("loss", math.nan), eps_spent=last["epsilon"],
        eps_target=self.target_epsilon,
        tokens_per_s=last["tokens_per_second"],
        clipped=last.get("clipped_fraction", math.nan),
        mixed=(last["dp_steps"], last["public_steps"],
               last.get("public_loss", math.nan)) if self.mixed else None)
    self.last = last
    self._reset()


class Evaluator:
  """Every `period` steps (and at the last): the mean eval loss of the
  params (`evaluate(params) -> float`) -> TensorBoard `eval/`, console."""

  def __init__(self, *, period: int, evaluate: Callable[[Any], float],
               summaries: reporting.Summaries):
    self.period, self.evaluate, self.summaries = period, evaluate, summaries
    self.last_loss: float | None = None

  def __call__(self, step: int, state, output: StepOutput, final: bool):
    del output
    if step % self.period and not final:
      return
    self.last_loss = self.evaluate(state.params)
    self.summaries.scalars("eval", step, {"loss": self.last_loss})
    reporting.say(f"step {step} eval loss {self.last_loss:.4f}")


class Checkpointer:
  """Every `period` steps and at the last (a stop included): the state and
  `meta(step)` (`checkpoints.RunMeta`), then the ledger file."""

  def __init__(self, *, period: int, manager, model_dir: str,
               meta: Callable[[int], checkpoints.RunMeta], key: bytes):
    self.period, self.manager, self.model_dir, self.meta = (period, manager,
                                                            model_dir, meta)
    self.key = key  # the run secret's `meta_key()`: the meta's MAC

  def __call__(self, step: int, state, output: StepOutput, final: bool):
    del output
    if step % self.period == 0 or final:
      checkpoints.save(self.manager, step, state, self.meta(step),
                       self.model_dir, self.key)


def window_metrics(dp: list[dict], public: list[dict], dp_steps: int,
                   num_tokens: int, seconds: float) -> dict:
  """Aggregates the metrics of the steps since the last report: `accumulate`'s
  of the DP steps, and the loss of the public steps as `public_loss`."""
  metrics = {"tokens_per_second": num_tokens / max(seconds, 1e-9)}
  # One loss: plain names; several: `name/...` per loss, and `loss` their sum.
  prefixes = sorted(k[:-len("loss_sum")] for k in (dp[0] if dp else {})
                    if k.endswith("loss_sum"))
  for p in prefixes:
    real = sum(h[p + "num_examples"] for h in dp)
    metrics.update({
        p + "loss": sum(h[p + "loss_sum"] for h in dp) / max(real, 1),
        p + "clipped_fraction":
            sum(h[p + "num_clipped"] for h in dp) / max(real, 1),
        p + "nonfinite_examples": float(sum(h[p + "num_nonfinite"] for h in dp)),
        p + "examples_per_step": real / max(dp_steps, 1),
        # Per call: norm quantiles, adaptive clipping's bound in use.
        **{q: float(np.mean([h[q] for h in dp])) for q in dp[0]
           if q.startswith(p + "grad_norm_p") or q == p + "clip_norm"},
    })
  if prefixes and "" not in prefixes:
    metrics["loss"] = sum(metrics[p + "loss"] for p in prefixes)
    metrics["clipped_fraction"] = max(metrics[p + "clipped_fraction"]
                                      for p in prefixes)
  if public:
    metrics["public_loss"] = (sum(h["loss_sum"] for h in public)
                              / max(sum(h["num_examples"] for h in public), 1))
  return metrics
