"""The jit-compiled DP train step, split in two so that shapes stay static.

One logical batch (one noisy release) is processed as:

  grads = zeros
  for each group of K microbatches of the sampled batch:   # normally once
    grads = accumulate(params, grads, group)              # clip per example
  state = apply(state, grads)                             # noise once, update

`accumulate` scans over K microbatches of m examples each, clipping every
example's gradient inside its microbatch and adding to the running sums, one
per named loss (`{LOSS: sum}` for a model with one loss). `apply` hands the
clipped sums to a DP optimizer (dpjax.privacy.optimizers), which adds the
Gaussian noise exactly once per sum, keyed by the state's `noise_count`, and
normalises before the base optimizer. A Poisson sample larger than K*m
(rare by construction of the sampler) costs one more `accumulate` call with
the same compiled shapes, so no sampled example is ever dropped and the
accountant's model stays exact.

A model with several named losses (`clipping.multi_loss_clipped_grad`, e.g.
GPT-2 + discriminator head) is the same path with more names: each sum is its
own release, and the metrics are those of one loss per `name/` prefix (a
single loss keeps plain names).

A run with a redaction schedule (dpjax.privacy.redaction_schedule) also takes
non-private steps on public (redacted) batches: `public_step` is the plain
mean gradient over the real rows, scanned over K microbatches, and the DP
optimizer's base update on the same optimizer state; it makes no release
and leaves `noise_count` alone.

Nothing here imports TensorFlow.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpjax.privacy import adaptive_clipping as adaptive
from dpjax.privacy import clipping, optimizers

PyTree = Any
# The name of a model's one loss: its clipped sum is release {LOSS: sum}.
LOSS = "loss"

NORM_QUANTILES = (0.5, 0.9, 0.99)
_DROPOUT_STREAM = 0x0D50
_PUBLIC_DROPOUT_STREAM = 0x9D50


class TrainState(NamedTuple):
  """`step`: optimizer updates taken, DP and public (int32 scalar);
  `opt_state`: the base optimizer's; `noise_count`: the DP releases made,
  the index that keys the next one's noise. In a run without public steps
  `step == noise_count`. `clip_norms`: with adaptive clipping, each loss's
  current bound `{name: float32}` (a function of earlier releases); None
  (no leaves) with fixed bounds. `noise_state`: BandMF's correlated-noise
  state (`bandmf.correlated_privatizer`: past noise, SECRET); None with
  independent noise."""
  step: jax.Array
  params: PyTree
  opt_state: optax.OptState
  noise_count: jax.Array
  clip_norms: Any = None
  noise_state: Any = None


def init_state(params: PyTree, optimizer: optimizers.DPOptimizer |
               optax.GradientTransformation) -> TrainState:
  zero = jnp.zeros((), jnp.int32)
  initial = getattr(optimizer, "initial_clip_norms", None)
  clip_norms = None if initial is None else {
      k: jnp.asarray(c, jnp.float32) for k, c in initial.items()}
  noise_init = getattr(optimizer, "noise_state_init", None)
  return TrainState(zero, params, optimizer.init(params), zero, clip_norms,
                    None if noise_init is None else noise_init(params))


def sensitivities(clipped_grad) -> dict[str, float]:
  """The L2 sensitivity of each named sum `make_accumulate` builds from a
  clipped-gradient function (one loss: `{LOSS: its sensitivity}`)."""
  if isinstance(clipped_grad, clipping.MultiClippedGrad):
    return dict(clipped_grad.sensitivities)
  return {LOSS: clipped_grad.sensitivity}


def dropout_keys(seed: int, step, call: int, shape, *,
                 stream: int = _DROPOUT_STREAM) -> jax.Array:
  """Per-example dropout keys for microbatch group `call` of DP step `step`
  (of public step `step` with `stream=_PUBLIC_DROPOUT_STREAM`)."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), stream)
  key = jax.random.fold_in(jax.random.fold_in(key, step), call)
  return jax.random.split(key, math.prod(shape)).reshape(*shape, -1)


def _sum_stats(stats: clipping.ClipStats) -> dict[str, jax.Array]:
  return dict(
      loss_sum=stats.losses.sum(),
      num_examples=stats.num_examples,
      num_clipped=stats.num_clipped,
      num_nonfinite=stats.num_nonfinite,
  )


def make_accumulate(clipped_grad, *, seed: int, dropout: bool) -> Callable:
  """(params, sums, batch[K,m,...], mask[K,m], step, call, clip_norms=None)
  -> (sums, metrics).

  `clipped_grad`: a `clipping.ClippedGradFn` (one loss) or a
  `multi_loss_clipped_grad`; `sums` is `{name: running clipped sum}` with the
  names of `sensitivities(clipped_grad)`. Metrics are sums over real
  examples, plus quantiles of the per-example gradient norms before
  clipping (`name/metric` with several losses). `dropout`: give every
  example a `dropout_rng` key (`dropout_keys`), for dropout or a loss's own
  randomness.

  Adaptive clipping (`clip_norms`, the state's `{name: C}`): `clipped_grad`
  clips the losses of `adaptive_clipping.scaled_loss` to 1, so the sums are
  in units of C, and `sums[adaptive_clipping.UNCLIPPED]` (`{name: 0.}` from
  `zeros_like_sums`) adds up each loss's centred count of unclipped
  examples; the metrics (losses, norms) are in the loss's own units, with
  the `clip_norm` used.
  """
  single = not isinstance(clipped_grad, clipping.MultiClippedGrad)

  def named(params, mb, mb_mask):
    grad_sum, stats = clipped_grad(params, mb, mb_mask)
    return ({LOSS: grad_sum}, {LOSS: stats}) if single else (grad_sum, stats)

  def accumulate(params, grads, batch, mask, step, call, clip_norms=None):
    if dropout:
      batch = dict(batch, dropout_rng=dropout_keys(seed, step, call,
                                                   mask.shape))
    if clip_norms is not None:
      batch = adaptive.with_inverse_clip_norms(batch, clip_norms, mask)

    def one_microbatch(acc, microbatch):
      grad_sums, stats = named(params, *microbatch)
      if clip_norms is not None:
        grad_sums[adaptive.UNCLIPPED] = {
            k: adaptive.centred_count(s.num_examples, s.num_clipped)
            for k, s in stats.items()}
      acc = jax.tree.map(jnp.add, acc, grad_sums)
      return acc, ({k: _sum_stats(s) for k, s in stats.items()},
                   {k: s.norms for k, s in stats.items()})

    grads, (sums, norms) = jax.lax.scan(one_microbatch, grads, (batch, mask))
    if clip_norms is not None:  # back from units of C
      for k, c in clip_norms.items():
        sums[k]["loss_sum"] = sums[k]["loss_sum"] * c
        norms[k] = norms[k] * c
    metrics = {name: _metrics(sums[name], norms[name], mask)
               for name in norms}
    if clip_norms is not None:
      for k, c in clip_norms.items():
        metrics[k]["clip_norm"] = c
    if single:
      return grads, metrics[LOSS]
    return grads, {f"{name}/{key}": value for name in metrics
                   for key, value in metrics[name].items()}

  return accumulate


def _metrics(sums, norms, mask):
  metrics = jax.tree.map(lambda x: x.sum(0), sums)
  real_norms = jnp.where(mask > 0, norms, jnp.nan).reshape(-1)
  for q in NORM_QUANTILES:
    metrics[f"grad_norm_p{int(q * 100)}"] = jnp.nanquantile(real_norms, q)
  return metrics


def make_apply(optimizer: optimizers.DPOptimizer,
               adaptive_clipping: adaptive.AdaptiveClipping | None = None,
               normalizer: float | None = None) -> Callable:
  """(state, clipped sums, noise_secret) -> state: one noisy release (index
  `state.noise_count`) and update. `noise_secret` (uint32[4], the run's
  `RunSecret.noise_key()`) is an argument, so it is never a constant of the
  compiled program.

  With `adaptive_clipping` (resolved: its `count_stddev` set) the sums are
  in units of the state's clip norms (`make_accumulate`): the same release
  also noises each loss's unclipped count (its own key stream,
  `adaptive_clipping.count_keys`), the update is scaled back by C, and C
  moves toward the target quantile for the next step."""

  def apply(state: TrainState, sums, noise_secret) -> TrainState:
    clip_norms = state.clip_norms
    if adaptive_clipping is not None:
      sums = dict(sums)
      counts = sums.pop(adaptive.UNCLIPPED)
    updates, opt_state, noise_state = optimizer.update(
        sums, state.opt_state, state.params, count=state.noise_count,
        noise_secret=noise_secret, scales=clip_norms,
        noise_state=state.noise_state)
    params = optax.apply_updates(state.params, updates)
    if adaptive_clipping is not None:
      clip_norms = {}
      for k, name in enumerate(state.clip_norms):
        fraction = adaptive.noisy_unclipped_fraction(
            counts[name], adaptive.count_keys(noise_secret, state.noise_count,
                                              k),
            adaptive_clipping.count_stddev, normalizer)
        clip_norms[name] = adaptive.next_clip_norm(
            state.clip_norms[name], fraction,
            adaptive_clipping.target_quantile, adaptive_clipping.learning_rate)
    return TrainState(state.step + 1, params, opt_state,
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


def zeros_like_sums(params: PyTree, names, adaptive_clipping: bool) -> dict:
  """The accumulator of one logical batch: `{name: zeros like params}`, and
  with adaptive clipping `{adaptive_clipping.UNCLIPPED: {name: 0.}}`."""
  sums = {k: zeros_like_f32(params) for k in names}
  if adaptive_clipping:
    sums[adaptive.UNCLIPPED] = {k: jnp.zeros((), jnp.float32) for k in names}
  return sums
