"""The base optimizer a DP step feeds, and its learning-rate schedule.

The optimizer is chosen by name (`OPTIMIZERS`); a model with frozen layers
gets `optax.masked` zero updates there (`optimizers.freeze`). A DP step
runs it after its mechanism's release, a public step alone, on the same
state.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from dpjax import errors
from dpjax.training import run_config
from dpjax.privacy import optimizers
from dpjax.privacy.mechanisms import multi_loss

OPTIMIZERS = {"sgd": optax.sgd, "adam": optax.adam, "adamw": optax.adamw,
              "adafactor": optax.adafactor}


def learning_rate_schedule(settings: run_config.LearningRateSchedule,
                           total_steps: int | None = None) -> optax.Schedule:
  """`settings`' schedule over `total_steps`: 'constant' | 'linear_decay' |
  'cosine' | 'rsqrt', after linear warmup. The same function for the same
  schedule (memoized), so steps placed with it are found again
  (`step.place_steps`)."""
  if settings.name in ("constant", "rsqrt"):  # the length changes nothing
    total_steps = None
  return _schedule(settings, total_steps)


@functools.lru_cache(maxsize=32)
def _schedule(settings: run_config.LearningRateSchedule,
              total_steps: int | None) -> optax.Schedule:
  learning_rate, name = settings.learning_rate, settings.name
  warmup_steps = settings.warmup_steps
  decay_steps = max((total_steps or 1) - warmup_steps, 1)
  if name == "constant":
    after = optax.constant_schedule(learning_rate)
  elif name == "linear_decay":
    after = optax.linear_schedule(learning_rate, 0.0, decay_steps)
  elif name == "cosine":
    after = optax.cosine_decay_schedule(learning_rate, decay_steps)
  elif name == "rsqrt":
    after = lambda s: learning_rate * jax.lax.rsqrt(
        jnp.maximum(s, 1.0) / max(warmup_steps, 1))
  else:
    raise errors.UsageError(f"unknown learning-rate schedule {name!r}")
  if warmup_steps <= 0:
    return after
  return optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, warmup_steps), after],
      [warmup_steps])


def base_optimizer(model, optimizer: str,
                   learning_rate: optax.ScalarOrSchedule
                   ) -> optax.GradientTransformation:
  """The named optax optimizer, frozen where the model's mask says so."""
  if optimizer not in OPTIMIZERS:
    raise errors.UsageError(f"unknown optimizer {optimizer!r}; choose from "
                             f"{sorted(OPTIMIZERS)}")
  base = OPTIMIZERS[optimizer](learning_rate)
  mask = multi_loss.trainable_mask(model)
  if mask is None or all(jax.tree.leaves(mask)):
    return base
  return optimizers.freeze(base, mask)
