"""The step builder: a model and the run's settings -> its jitted steps.

`build_dp_step` gives the DP optimizer and the un-jitted DP step in its two
halves (`accumulate`: clip and sum per microbatch group; `apply`: one noisy
release and update; see `dpjax.training.train_step`), `build_public_step` the
non-private step of a redaction schedule on the same optimizer state, and
`place_steps` jits them for a mesh: params and optimizer state by their
logical axes, batches split over the example axis, buffers donated.

The base optimizer is chosen by name (`OPTIMIZERS`); a model with frozen
layers gets `optax.masked` zero updates there (`freeze`). Nothing here
reads data or imports TensorFlow.
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import errors
from dpjax.training import partitioning, run_config, train_step
from dpjax.models import trainable as trainable_lib
from dpjax.privacy import adaptive_clipping as adaptive
from dpjax.privacy import bandmf
from dpjax.privacy import clipping
from dpjax.privacy.clipping_method import make_clipped_grad
from dpjax.privacy import optimizers as dp_optimizers

# Base optimizers: a DP step runs `dp_optimizers.dp_optimizer(base)`, a public
# step `base` alone on the same state.
OPTIMIZERS = {"sgd": optax.sgd, "adam": optax.adam, "adamw": optax.adamw,
              "adafactor": optax.adafactor}
CLIPPING_METHODS = ("vmap", "ghost", "auto")


def learning_rate_schedule(settings: run_config.LearningRateSchedule,
                           total_steps: int | None = None) -> optax.Schedule:
  """`settings`' schedule over `total_steps`: 'constant' | 'linear_decay' |
  'cosine' | 'rsqrt', after linear warmup."""
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


def trainable_mask(model: trainable_lib.Trainable):
  """The model's trainable-leaf mask (of its abstract params), or None."""
  if model.trainable_mask is None:
    return None
  return model.trainable_mask(model.abstract_params()[0])


def base_optimizer(model: trainable_lib.Trainable, optimizer: str,
                   learning_rate: optax.ScalarOrSchedule
                   ) -> optax.GradientTransformation:
  """The named optax optimizer, frozen where the model's mask says so."""
  if optimizer not in OPTIMIZERS:
    raise errors.UsageError(f"unknown optimizer {optimizer!r}; choose from "
                             f"{sorted(OPTIMIZERS)}")
  base = OPTIMIZERS[optimizer](learning_rate)
  mask = trainable_mask(model)
  if mask is None or all(jax.tree.leaves(mask)):
    return base
  return dp_optimizers.freeze(base, mask)


def loss_clip_norms(model: trainable_lib.Trainable, clip_norm: float,
                    clip_norms: Mapping[str, float] | None
                    ) -> dict[str, float] | None:
  """A multi-loss model's bound per loss (`clip_norms`, else `clip_norm`
  for every loss); None for a one-loss model."""
  if model.example_losses is None:
    if clip_norms:
      raise errors.UsageError(
          f"train.clip_norms {dict(clip_norms)} is for a model with several "
          "losses; this one has one: set train.clip_norm")
    return None
  extra = set(clip_norms or {}) - set(model.loss_names)
  if extra:
    raise errors.UsageError(f"train.clip_norms names {sorted(extra)}; the "
                             f"model's losses are {list(model.loss_names)}")
  return {k: float((clip_norms or {}).get(k, clip_norm))
          for k in model.loss_names}


def build_dp_step(model: trainable_lib.Trainable, *, clip_norm: float,
                  optimizer: str, learning_rate: optax.ScalarOrSchedule,
                  noise_multiplier: float, normalizer: float, seed: int,
                  clipping_method: str = "vmap",
                  clip_norms: Mapping[str, float] | None = None,
                  adaptive_clipping: adaptive.AdaptiveClipping | None = None,
                  strategy: bandmf.Strategy | None = None):
  """(DP optimizer, accumulate, apply) for a model: the un-jitted DP step.

  `clipping_method`: 'vmap' (per-example gradients), 'ghost' (ghost norms:
  no per-example weight gradients) or 'auto' (ghost when the
  model has intercepted layers); all give the same clipped sum and bound.
  Only the trained leaves are clipped (`Trainable.trainable_mask`, e.g.
  LoRA's adapters). A multi-loss model (`loss_clip_norms`) clips by vmap
  only ('auto' is vmap):
  one clipped sum per loss, noised separately with the one σ; a one-loss
  model is the case of one sum, `{train_step.LOSS: sum}`. With
  rematerialised layers (a config's `remat`) ghost clipping takes its sum
  from a second backward pass instead of book-keeping (`ghost.py`).
  `seed` keys dropout only (public); `apply(state, grads, noise_secret)`
  takes the run's secret noise key (`RunSecret.noise_key()`).

  `adaptive_clipping` (resolved: `count_stddev` set; `clip_norm` and
  `clip_norms` are then unused): every loss starts at its
  `initial_clip_norm` and follows its target quantile
  (`dpjax.privacy.adaptive_clipping`); the losses are clipped in units of
  their bound (sensitivity 1), and `accumulate` takes the state's
  `clip_norms`.

  `strategy` (`train.mechanism = 'bandmf'`): BandMF's correlated noise in
  place of independent noise (`dpjax.privacy.bandmf`), one loss at a
  fixed bound.
  """
  if clipping_method not in CLIPPING_METHODS:
    raise errors.UsageError("train.clipping_method must be 'vmap', 'ghost' "
                             f"or 'auto', got {clipping_method!r}")
  example_loss, example_losses = model.example_loss, model.example_losses
  if adaptive_clipping is not None:
    if clip_norms:
      raise errors.UsageError(
          "train.clip_norms sets fixed bounds; with train.clip_norm = "
          "'adaptive' every loss starts at adaptive_clipping.initial_clip_norm")
    clip_norm, clip_norms = 1.0, None  # in units of each loss's bound
    if example_losses is None:
      example_loss = adaptive.scaled_loss(example_loss, train_step.LOSS)
    else:
      example_losses = adaptive.scaled_losses(example_losses,
                                              model.loss_names)
  bounds = loss_clip_norms(model, clip_norm, clip_norms)
  if bounds is None:  # one loss; the trained leaves only, where some are not
    clipped = make_clipped_grad(example_loss, clip_norm=clip_norm,
                                method=clipping_method,
                                trainable=trainable_mask(model))
  elif clipping_method == "ghost":
    raise errors.UsageError(
        "train.clipping_method = 'ghost' does not support a model with "
        "several losses; use 'vmap'")
  else:
    clipped = clipping.multi_loss_clipped_grad(
        example_losses, clip_norms=bounds, trainable=trainable_mask(model))
  sensitivities = train_step.sensitivities(clipped)
  if strategy is not None:
    if len(sensitivities) != 1 or adaptive_clipping is not None:
      raise errors.UsageError(
          "train.mechanism = 'bandmf' noises one loss at a fixed clip norm: "
          "not a model with several losses or train.clip_norm = 'adaptive'")
    (sensitivity,) = sensitivities.values()
    tx = dp_optimizers.bandmf_optimizer(
        base_optimizer(model, optimizer, learning_rate), strategy,
        noise_multiplier=noise_multiplier, sensitivity=sensitivity,
        normalizer=normalizer, trainable=trainable_mask(model))
  else:
    tx = dp_optimizers.dp_optimizer(
        base_optimizer(model, optimizer, learning_rate),
        noise_multipliers={k: noise_multiplier for k in sensitivities},
        sensitivities=sensitivities, normalizer=normalizer,
        trainable=trainable_mask(model),
        initial_clip_norms=None if adaptive_clipping is None else {
            k: adaptive_clipping.initial_clip_norm for k in sensitivities})
  accumulate = train_step.make_accumulate(clipped, seed=seed,
                                          dropout=model.example_rng)
  return tx, accumulate, train_step.make_apply(tx, adaptive_clipping,
                                               normalizer)


def build_public_step(model: trainable_lib.Trainable, *, optimizer: str,
                      learning_rate: optax.ScalarOrSchedule, seed: int):
  """The un-jitted non-private step on a public batch, on the state of
  `build_dp_step`'s DP optimizer (same `optimizer` and `learning_rate`)."""
  return train_step.make_public_step(
      model.example_loss, base_optimizer(model, optimizer, learning_rate),
      seed=seed, dropout=model.example_rng)


class PlacedSteps(NamedTuple):
  """A run's steps, jitted for its mesh (see `place_steps`)."""
  optimizer: dp_optimizers.DPOptimizer
  state_shardings: train_step.TrainState
  abstract_state: train_step.TrainState  # ShapeDtypeStructs with shardings
  zero_grads: Callable  # params -> {name: zero clipped sum} (+ counts)
  grads_shardings: dict  # of zero_grads' result
  accumulate: Callable  # (params, grads, batch, mask, index, call, C)
  apply: Callable  # (state, grads, noise_secret) -> state
  public: Callable  # (state, batch, mask, index) -> (state, metrics)
  eval: Callable  # (params, batch, mask) -> (loss sum, count)


def place_steps(model: trainable_lib.Trainable, *, mesh, rules,
                optimizer: str, learning_rate: optax.ScalarOrSchedule,
                clip_norm: float, clip_norms: Mapping[str, float] | None,
                noise_multiplier: float, normalizer: float, seed: int,
                clipping_method: str,
                adaptive_clipping: adaptive.AdaptiveClipping | None = None,
                strategy: bandmf.Strategy | None = None) -> PlacedSteps:
  """The DP, public and eval steps jitted on `mesh`: params by their logical
  axes (replicated, FSDP or tensor-parallel per `rules`), optimizer moments
  like their params, counters replicated; the state and clipped sums are
  donated."""
  tx, accumulate, apply = build_dp_step(
      model, clip_norm=clip_norm, optimizer=optimizer,
      learning_rate=learning_rate, noise_multiplier=noise_multiplier,
      normalizer=normalizer, seed=seed, clipping_method=clipping_method,
      clip_norms=clip_norms, adaptive_clipping=adaptive_clipping,
      strategy=strategy)
  abstract, axes = model.abstract_params()
  state_sh = partitioning.state_shardings(mesh, tx, abstract, axes, rules)
  target = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(lambda p: train_step.init_state(p, tx), abstract),
      state_sh)
  names = list(model.loss_names if model.example_losses is not None
               else [train_step.LOSS])
  replicated = partitioning.replicated(mesh)
  adapts = adaptive_clipping is not None
  grads_sh = {k: state_sh.params for k in names}  # one sum per loss
  if adapts:  # and each loss's count of unclipped examples
    grads_sh[adaptive.UNCLIPPED] = {k: replicated for k in names}
  return PlacedSteps(
      optimizer=tx, state_shardings=state_sh, abstract_state=target,
      zero_grads=jax.jit(
          lambda p: train_step.zeros_like_sums(p, names, adapts),
          out_shardings=grads_sh),
      grads_shardings=grads_sh,
      accumulate=jax.jit(accumulate, donate_argnums=(1,),
                         out_shardings=(grads_sh, replicated)),
      apply=jax.jit(apply, donate_argnums=(0,), out_shardings=state_sh),
      public=jax.jit(build_public_step(model, optimizer=optimizer,
                                       learning_rate=learning_rate, seed=seed),
                     donate_argnums=(0,), out_shardings=(state_sh, replicated)),
      eval=jax.jit(train_step.make_eval_step(model.batch_loss)))


def microbatch_groups(idx: np.ndarray, mask: np.ndarray, k: int):
  """Splits [K', m] index/mask arrays into groups of exactly k microbatches
  (the last padded with masked rows): one `accumulate` call each."""
  groups = []
  for start in range(0, len(idx), k):
    i, m = idx[start:start + k], mask[start:start + k]
    if len(i) < k:  # overflow remainder: pad with masked rows
      pad = k - len(i)
      i = np.concatenate([i, np.zeros((pad, i.shape[1]), i.dtype)])
      m = np.concatenate([m, np.zeros((pad, m.shape[1]), m.dtype)])
    groups.append((i, m))
  return groups
