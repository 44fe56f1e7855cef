"""One DP step, from the sampled batch to the update, jitted where it is placed.

A logical batch (one noisy release) is processed as:

  sums = zero_sums(params)                                 # one per loss
  for each group of K microbatches of the sampled batch:   # normally once
    sums, metrics = accumulate(params, sums, group)       # clip per example
  state = apply(state, sums)                              # noise once, update

`accumulate` scans over K microbatches of m examples each: the mechanism's
clipped-gradient callable (`mechanism.clipped_grad`: per-example gradients
clipped to their bound, summed, with the sum's sensitivity) adds to the
running sums, one per named loss (`multi_loss`); the mechanism may add to
them (`mechanism.accumulate`, `mechanism.extra_sums`). `apply` hands the
sums to the DP optimizer: the mechanism's release (`mechanism.privatizer`:
noise exactly once per sum, keyed by the state's `noise_count`), then the
base optimizer. A Poisson sample larger than K*m (rare by construction of
the sampler) costs one more `accumulate` call with the same compiled
shapes, so no sampled example is ever dropped and the accountant's model
stays exact.

A run with a redaction schedule (`mechanisms.redaction_schedule`) also takes
non-private steps on public (redacted) batches: `make_public_step` is the
plain mean gradient over the real rows, scanned over K microbatches, and the
base optimizer on the same state; it makes no release and leaves
`noise_count` alone.

`place_steps` jits the steps for a mesh: params and optimizer state by their
logical axes (the sums and moments also split over the batch's devices),
batches split over the example axis, buffers donated. Nothing
here reads data or imports TensorFlow.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.audit import canaries as canaries_lib
from dpjax.training import optimizer as optimizer_lib, partitioning
from dpjax.training.state import PyTree, TrainState, init_state
from dpjax.privacy import clipping, optimizers
from dpjax.privacy.mechanisms import DPSGD, multi_loss

NORM_QUANTILES = (0.5, 0.9, 0.99)
_DROPOUT_STREAM = 0x0D50
_PUBLIC_DROPOUT_STREAM = 0x9D50


def dropout_keys(seed: int, step, call: int, shape, *,
                 stream: int = _DROPOUT_STREAM) -> jax.Array:
  """Per-example dropout keys for microbatch group `call` of DP step `step`
  (of public step `step` with `stream=_PUBLIC_DROPOUT_STREAM`)."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), stream)
  key = jax.random.fold_in(jax.random.fold_in(key, step), call)
  return jax.random.split(key, math.prod(shape)).reshape(*shape, -1)


def make_accumulate(clipped_grad, *, seed: int, dropout: bool) -> Callable:
  """(params, sums, batch[K,m,...], mask[K,m], step, call, clip_norms=None)
  -> (sums, {name: metrics}).

  `clipped_grad`: a mechanism's clipped-gradient callable, one loss or
  several (`multi_loss.clipped_grad`); `sums` is `{name: running clipped
  sum}` with its names (`multi_loss.sensitivities`). Metrics are sums over
  real examples, plus quantiles of the per-example gradient norms before
  clipping. `dropout`: give every example a `dropout_rng` key
  (`dropout_keys`), for dropout or a loss's own randomness. `clip_norms`
  (the state's) is for the mechanism's `accumulate`, which wraps this one.
  """
  named = multi_loss.named(clipped_grad)

  def accumulate(params, sums, batch, mask, step, call, clip_norms=None):
    del clip_norms  # the mechanism's
    if dropout:
      batch = dict(batch, dropout_rng=dropout_keys(seed, step, call,
                                                   mask.shape))

    def one_microbatch(acc, microbatch):
      grad_sums, stats = named(params, *microbatch)
      acc = jax.tree.map(jnp.add, acc, grad_sums)
      return acc, ({k: _sum_stats(s) for k, s in stats.items()},
                   {k: s.norms for k, s in stats.items()})

    sums, (totals, norms) = jax.lax.scan(one_microbatch, sums, (batch, mask))
    return sums, {name: _metrics(totals[name], norms[name], mask)
                  for name in norms}

  return accumulate


def _sum_stats(stats: clipping.ClipStats) -> dict[str, jax.Array]:
  return dict(loss_sum=stats.losses.sum(), num_examples=stats.num_examples,
              num_clipped=stats.num_clipped,
              num_nonfinite=stats.num_nonfinite)


def _metrics(sums, norms, mask):
  metrics = jax.tree.map(lambda x: x.sum(0), sums)
  real_norms = jnp.where(mask > 0, norms, jnp.nan).reshape(-1)
  for q in NORM_QUANTILES:
    metrics[f"grad_norm_p{int(q * 100)}"] = jnp.nanquantile(real_norms, q)
  return metrics


def flat_metrics(accumulate: Callable) -> Callable:
  """`accumulate` with its metrics by name: a single loss's as they are,
  several as `name/metric`."""

  def flat(*args):
    sums, metrics = accumulate(*args)
    if list(metrics) == [multi_loss.LOSS]:
      return sums, metrics[multi_loss.LOSS]
    return sums, {f"{name}/{key}": value for name in metrics
                  for key, value in metrics[name].items()}

  return flat


def make_apply(optimizer: optimizers.DPOptimizer) -> Callable:
  """(state, clipped sums, noise_secret) -> state: one noisy release (index
  `state.noise_count`) and update. `noise_secret` (uint32[4], the run's
  `RunSecret.noise_key()`) is an argument, so it is never a constant of the
  compiled program."""

  def apply(state: TrainState, sums, noise_secret) -> TrainState:
    updates, opt_state, clip_norms, noise_state = optimizer.update(
        sums, state.opt_state, state.params, count=state.noise_count,
        noise_secret=noise_secret, clip_norms=state.clip_norms,
        noise_state=state.noise_state)
    return TrainState(state.step + 1,
                      optax.apply_updates(state.params, updates), opt_state,
                      state.noise_count + 1, clip_norms, noise_state)

  return apply


def make_public_step(example_loss: Callable,
                     base: optax.GradientTransformation, *, seed: int,
                     dropout: bool) -> Callable:
  """(state, batch[K,m,...], mask[K,m], index) -> (state, metrics).

  One NON-private step on a public batch: the mean over its real rows of the
  unclipped per-example loss gradients (a scan over the K microbatches), then
  `base` (the DP optimizer's base) on the shared optimizer state; the noise
  counter is untouched. `index` numbers the public steps (their dropout
  keys). Metrics: loss sum and number of real examples.
  """
  per_example = jax.vmap(example_loss, in_axes=(None, 0))

  def loss_sum(params, microbatch, mask):
    return jnp.where(mask > 0, per_example(params, microbatch), 0.0).sum()

  def public_step(state: TrainState, batch, mask, index):
    if dropout:
      batch = dict(batch, dropout_rng=dropout_keys(
          seed, index, 0, mask.shape, stream=_PUBLIC_DROPOUT_STREAM))

    def one_microbatch(acc, microbatch):
      mb, mb_mask = microbatch
      loss, grads = jax.value_and_grad(loss_sum)(state.params, mb, mb_mask)
      return jax.tree.map(jnp.add, acc, grads), loss

    grads, losses = jax.lax.scan(one_microbatch,
                                 zeros_like_f32(state.params), (batch, mask))
    count = mask.sum()
    grads = jax.tree.map(lambda g: g / jnp.maximum(count, 1.0), grads)
    updates, opt_state = base.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return (state._replace(step=state.step + 1, params=params,
                           opt_state=opt_state),
            {"loss_sum": losses.sum(), "num_examples": count})

  return public_step


def make_eval_step(batch_loss: Callable) -> Callable:
  """(params, batch, mask) -> (sum of per-example losses, number of examples)."""

  def eval_step(params, batch, mask):
    losses = batch_loss(params, batch)
    return jnp.where(mask > 0, losses, 0.0).sum(), mask.sum()

  return eval_step


def zeros_like_f32(params: PyTree) -> PyTree:
  return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)


def zero_sums(params: PyTree, names, mechanism: DPSGD = DPSGD()) -> dict:
  """The accumulator of one logical batch: `{name: zeros like params}` and
  the mechanism's `extra_sums`."""
  return {**{k: zeros_like_f32(params) for k in names},
          **mechanism.extra_sums(names)}


def build_dp_step(model, mechanism: DPSGD = DPSGD(), *, clip_norm: float,
                  optimizer: str, learning_rate: optax.ScalarOrSchedule,
                  noise_multiplier: float, normalizer: float, seed: int,
                  clipping_method: str = "vmap",
                  ghost_summation: str = "auto",
                  clip_norms: Mapping[str, float] | None = None):
  """(DP optimizer, accumulate, apply) for a model under `mechanism`: the
  un-jitted DP step.

  `clipping_method`: 'vmap' (per-example gradients), 'ghost' (ghost norms:
  no per-example weight gradients) or 'auto' (ghost when the model has
  intercepted layers); all give the same clipped sum and bound, and so does
  ghost's `ghost_summation` ('auto' | 'book_keeping' | 'second_pass',
  `ghost.ghost_clipped_grad`'s `summation`). Only the
  trained leaves are clipped (`Trainable.trainable_mask`, e.g. LoRA's
  adapters). A multi-loss model clips each loss to its `clip_norms` entry
  (default `clip_norm`) by vmap only. `seed` keys dropout only (public);
  `apply(state, sums, noise_secret)` takes the run's secret noise key
  (`RunSecret.noise_key()`).
  """
  clipped = clipped_grad(model, mechanism, clip_norm, clip_norms,
                         clipping_method, ghost_summation)
  tx = dp_optimizer(model, mechanism, clipped, optimizer=optimizer,
                    learning_rate=learning_rate,
                    noise_multiplier=noise_multiplier, normalizer=normalizer)
  return tx, dp_accumulate(model, mechanism, clipped, seed=seed), make_apply(tx)


def clipped_grad(model, mechanism: DPSGD, clip_norm: float,
                 clip_norms: Mapping[str, float] | None,
                 clipping_method: str, ghost_summation: str = "auto"
                 ) -> Callable:
  """The mechanism's clipped-gradient callable for `model`, one bound per
  named loss (`multi_loss.release_bounds`)."""
  return mechanism.clipped_grad(
      model, clip_norm=clip_norm,
      bounds=multi_loss.release_bounds(model, clip_norm, clip_norms),
      method=clipping_method, summation=ghost_summation)


def dp_optimizer(model, mechanism: DPSGD, clipped: Callable, *,
                 optimizer: str, learning_rate: optax.ScalarOrSchedule,
                 noise_multiplier: float, normalizer: float,
                 canaries: canaries_lib.GradientCanaries | None = None
                 ) -> optimizers.DPOptimizer:
  """The mechanism's release (noise scaled to `clipped`'s sensitivities)
  followed by the base optimizer; with `canaries` (an audit run,
  `dpjax.audit`), releases that carry them and keep what they show."""
  sensitivities = multi_loss.sensitivities(clipped)
  privatizer = mechanism.privatizer(
      sensitivities=sensitivities, noise_multiplier=noise_multiplier,
      normalizer=normalizer, trainable=multi_loss.trainable_mask(model),
      layouts=model.abstract_params()[1])
  if canaries is not None:
    privatizer = canaries_lib.audited(privatizer, canaries, sensitivities)
  return optimizers.DPOptimizer(
      privatizer, optimizer_lib.base_optimizer(model, optimizer,
                                               learning_rate))


def dp_accumulate(model, mechanism: DPSGD, clipped: Callable, *,
                  seed: int) -> Callable:
  """`make_accumulate` of `clipped` as the mechanism wraps it, its metrics
  flat by name. It does not depend on the noise or the optimizer."""
  return flat_metrics(mechanism.accumulate(
      make_accumulate(clipped, seed=seed, dropout=model.example_rng)))


class PlacedSteps(NamedTuple):
  """A run's steps, jitted for its mesh (see `place_steps`)."""
  state_shardings: TrainState
  abstract_state: TrainState  # ShapeDtypeStructs with shardings
  init: Callable  # params -> the initial state, in place
  zero_sums: Callable  # params -> the accumulator of one logical batch
  sums_shardings: dict  # of zero_sums' result
  accumulate: Callable  # (params, sums, batch, mask, index, call, C)
  apply: Callable  # (state, sums, noise_secret, σ) -> state
  public: Callable  # (state, batch, mask, index) -> (state, metrics)
  eval: Callable  # (params, batch, mask) -> (loss sum, count)


def place_steps(model, mechanism: DPSGD, *, mesh, rules, optimizer: str,
                learning_rate: optax.ScalarOrSchedule, clip_norm: float,
                clip_norms: Mapping[str, float] | None,
                normalizer: float, seed: int, clipping_method: str,
                ghost_summation: str = "auto",
                canaries: canaries_lib.GradientCanaries | None = None
                ) -> PlacedSteps:
  """The DP, public and eval steps jitted on `mesh` (with `canaries`, an
  audit run's: `dp_optimizer`): params by their logical
  axes (replicated, FSDP or tensor-parallel per `rules`); gradient sums, noise
  and optimizer moments like their params, spread over the batch's devices
  (`partitioning.update_spec`); counters and the mechanism's small sums
  replicated;
  the state and clipped sums are donated.

  Memoized on its arguments (the model by `trainable.trainable`'s own memo):
  a second run of the same model and settings in one process (a pipeline's
  runs, a resume) gets the same jitted functions, whose in-memory cache then
  neither traces nor compiles again. σ is `apply`'s last argument (the
  plan's), not a constant of its program, so runs that differ only in σ
  (runs of other lengths calibrate another) share every step; the gradient side
  (`zero_sums`, `accumulate`, `eval`: the costly compiles) is memoized
  apart from the optimizer too. Arguments that cannot be hashed (a schedule
  is hashed by identity) are placed afresh.
  """
  return _memoized(
      _place_steps, model, mechanism, mesh, rules, optimizer, learning_rate,
      clip_norm,
      None if clip_norms is None else tuple(sorted(clip_norms.items())),
      normalizer, seed, clipping_method, ghost_summation, canaries)


def _memoized(placed: Callable, *args):
  """`placed(*args)` from its LRU cache, or afresh when an argument cannot
  be hashed."""
  try:
    hash(args)
  except TypeError:
    return placed.__wrapped__(*args)
  return placed(*args)


class _GradientSteps(NamedTuple):
  """The jitted steps that do not depend on the noise or the optimizer, and
  the clipped-gradient callable they were built from (its sensitivities
  size the noise)."""
  clipped: Callable
  zero_sums: Callable
  sums_shardings: dict
  accumulate: Callable
  eval: Callable


@functools.lru_cache(maxsize=8)
def _gradient_steps(model, mechanism, mesh, rules, clip_norm, clip_norms,
                    seed, clipping_method, ghost_summation) -> _GradientSteps:
  clipped = clipped_grad(model, mechanism, clip_norm,
                         None if clip_norms is None else dict(clip_norms),
                         clipping_method, ghost_summation)
  laid_out = lambda fn: partitioning.batch_laid_out(fn, mesh, rules)
  abstract, axes = model.abstract_params()
  names = multi_loss.release_names(model)
  replicated = partitioning.replicated(mesh)
  sums_sh = {k: partitioning.update_shardings(mesh, axes, rules, abstract)
             for k in names}  # one sum per loss, laid out for the update
  sums_sh.update(jax.tree.map(lambda _: replicated,
                              mechanism.extra_sums(names)))
  return _GradientSteps(
      clipped=clipped,
      zero_sums=jax.jit(lambda p: zero_sums(p, names, mechanism),
                        out_shardings=sums_sh),
      sums_shardings=sums_sh,
      accumulate=jax.jit(laid_out(dp_accumulate(model, mechanism, clipped,
                                                seed=seed)),
                         donate_argnums=(1,),
                         out_shardings=(sums_sh, replicated)),
      eval=jax.jit(laid_out(make_eval_step(model.batch_loss))))


@functools.lru_cache(maxsize=8)  # a few runs' executables, not a suite's
def _place_steps(model, mechanism, mesh, rules, optimizer, learning_rate,
                 clip_norm, clip_norms, normalizer, seed,
                 clipping_method, ghost_summation, canaries) -> PlacedSteps:
  gradients = _memoized(_gradient_steps, model, mechanism, mesh, rules,
                        clip_norm, clip_norms, seed, clipping_method,
                        ghost_summation)
  optimizer_for = lambda sigma: dp_optimizer(
      model, mechanism, gradients.clipped, optimizer=optimizer,
      learning_rate=learning_rate, noise_multiplier=sigma,
      normalizer=normalizer, canaries=canaries)
  # The state's structure and layout: σ only scales the noise.
  tx = optimizer_for(0.0)
  abstract, axes = model.abstract_params()
  state_sh = partitioning.state_shardings(mesh, tx, abstract, axes, rules)
  target = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(lambda p: init_state(p, tx), abstract), state_sh)
  replicated = partitioning.replicated(mesh)

  def apply(state, sums, noise_secret, noise_multiplier):
    return make_apply(optimizer_for(noise_multiplier))(state, sums,
                                                       noise_secret)

  return PlacedSteps(
      state_shardings=state_sh, abstract_state=target,
      init=jax.jit(lambda p: init_state(p, tx), out_shardings=state_sh),
      zero_sums=gradients.zero_sums,
      sums_shardings=gradients.sums_shardings,
      accumulate=gradients.accumulate,
      apply=jax.jit(apply, donate_argnums=(0,), out_shardings=state_sh),
      public=jax.jit(partitioning.batch_laid_out(make_public_step(
          model.example_loss,
          optimizer_lib.base_optimizer(model, optimizer, learning_rate),
          seed=seed, dropout=model.example_rng), mesh, rules),
                     donate_argnums=(0,), out_shardings=(state_sh, replicated)),
      eval=gradients.eval)


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
