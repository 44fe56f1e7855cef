"""Adaptive clipping: a clip norm that follows a private quantile of the
per-example gradient norms (Andrew et al., "Differentially Private Learning
with Adaptive Clipping", NeurIPS 2021).

Each DP step clips with the current bound C (one per named loss), counts
the real examples whose gradient norm was at most C, releases that count
with Gaussian noise, and moves C geometrically toward the target quantile γ:

    f̃ = (Σ_i (b_i - 1/2) + N(0, σ_b²)) / B + 1/2      b_i = [‖g_i‖ <= C]
    C ← C · exp(-η (f̃ - γ))

(B: the data-independent normalizer, the expected batch size). The step's
gradient release is computed in units of C: each example's gradient of
`loss / C` is clipped to 1 (`scaled_loss`), the sum gets N(0, σ²) and the
release is multiplied back by C, which is `clip(g, C) = C · clip(g / C, 1)`
with noise σ·C: DP-SGD at bound C, with C a function of earlier releases only.

Formal guarantees
-----------------
Under add-or-remove-one adjacency an example changes the centred count
`Σ (b_i - 1/2)` by exactly 1/2 and the unit-space gradient sum by at most 1,
whatever C is (C is fixed before the step's data is seen). So one step is,
per named loss, two Gaussian mechanisms on the same Poisson sample: the
gradient sum with noise multiplier σ and the count with noise multiplier
`count_noise_multiplier = 2 σ_b`. The ledger records both
(`accounting.PoissonGaussian(q, (σ,)*k + (2σ_b,)*k, T)`), equivalent to one
Gaussian with `(σ^-2 + (2σ_b)^-2)^-1/2` as in the paper's Theorem 1; σ is
calibrated with the counts in the composition, so the step's ε meets the
target. The count's noise is keyed by `(secret, COUNT_STREAM, release, k)`,
independent of the gradient noise. The new C, the scaled update and the
logged fraction are post-processing.

`AdaptiveDPSGD` is the mechanism (`train.clip_norm = 'adaptive'`): DP-SGD
whose bound is this state, clipped in units of C, with the count released
beside each gradient sum.

Limits: the count uses the unit-space norms of the differentiated (trained)
leaves, as the clipping does; an example whose loss or gradient is
non-finite is zeroed and counts as unclipped (b_i = 1: still one example's
worth of change).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp

from dpjax import errors
from dpjax.privacy import noise, optimizers
from dpjax.privacy.mechanisms import dpsgd, multi_loss

ADAPTIVE = "adaptive"  # train.clip_norm of adaptive clipping

# Batch fields the trainer adds: 1 / C of each loss, one per example.
INVERSE_CLIP_NORM = "inverse_clip_norm"
# Accumulator entries beside the gradient sums: Σ (b_i - 1/2) of each loss.
UNCLIPPED = "unclipped_count"
COUNT_STREAM = 0x636E7421  # "cnt!": apart from the gradient noise stream


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
  """`train.clip_norm = 'adaptive'`, set by gin as `adaptive_clipping.*`.

  Attributes:
    initial_clip_norm: C at the first step.
    target_quantile: γ, the fraction of examples meant to be unclipped
      (0.5: the median norm, the paper's recommendation).
    learning_rate: η of the geometric update (the paper's 0.2).
    count_stddev: σ_b, the count's noise in examples; None: the expected
      batch size / 20 (the paper's choice).
  """
  initial_clip_norm: float = 0.1
  target_quantile: float = 0.5
  learning_rate: float = 0.2
  count_stddev: float | None = None

  def __post_init__(self):
    if not (self.initial_clip_norm > 0 and math.isfinite(self.initial_clip_norm)):
      raise ValueError("adaptive_clipping.initial_clip_norm must be positive "
                       f"and finite, got {self.initial_clip_norm}")
    if not 0 < self.target_quantile < 1:
      raise ValueError("adaptive_clipping.target_quantile must be in (0, 1), "
                       f"got {self.target_quantile}")
    if not (self.learning_rate >= 0 and math.isfinite(self.learning_rate)):
      raise ValueError("adaptive_clipping.learning_rate must be >= 0, got "
                       f"{self.learning_rate}")
    if self.count_stddev is not None and not self.count_stddev > 0:
      raise ValueError("adaptive_clipping.count_stddev must be > 0, got "
                       f"{self.count_stddev}")

  def resolved(self, expected_batch_size: float) -> AdaptiveClipping:
    """With `count_stddev` set (default: expected batch size / 20)."""
    if self.count_stddev is not None:
      return self
    return dataclasses.replace(self,
                               count_stddev=float(expected_batch_size) / 20)

  @property
  def count_noise_multiplier(self) -> float:
    """σ_b over the centred count's sensitivity 1/2."""
    if self.count_stddev is None:
      raise ValueError("count_stddev is unset: call resolved() first")
    return 2.0 * self.count_stddev


def scaled_loss(loss_fn: Callable, name: str) -> Callable:
  """`loss_fn(params, example) / C`, C being loss `name`'s bound: the
  example's `INVERSE_CLIP_NORM` field holds `{name: 1 / C}` and `loss_fn`
  never sees it. Its gradient is g / C."""

  def scaled(params, example):
    example = dict(example)
    inverse = example.pop(INVERSE_CLIP_NORM)
    return loss_fn(params, example) * inverse[name]

  return scaled


def scaled_losses(losses_fn: Callable, names) -> Callable:
  """`{name: loss / C_name}` of a multi-loss function (see `scaled_loss`)."""

  def scaled(params, example):
    example = dict(example)
    inverse = example.pop(INVERSE_CLIP_NORM)
    losses = losses_fn(params, example)
    return {k: losses[k] * inverse[k] for k in names}

  return scaled


def with_inverse_clip_norms(batch: dict, clip_norms: Mapping[str, jax.Array],
                            mask: jax.Array) -> dict:
  """`batch` with every example's `{name: 1 / C}` (shaped like `mask`)."""
  return dict(batch, **{INVERSE_CLIP_NORM: {
      k: jnp.broadcast_to(1.0 / c, mask.shape) for k, c in clip_norms.items()}})


def centred_count(num_examples: jax.Array, num_clipped: jax.Array
                  ) -> jax.Array:
  """Σ_i (b_i - 1/2) over the real examples: unclipped ones count +1/2,
  clipped ones -1/2."""
  return (num_examples.astype(jnp.float32) / 2
          - num_clipped.astype(jnp.float32))


def count_keys(noise_secret: jax.Array, release: jax.Array, k: int
               ) -> jax.Array:
  """The key pair of loss k's count noise at release `release`."""
  return noise.stream_keys(noise_secret, COUNT_STREAM, release, k)


def noisy_unclipped_fraction(count: jax.Array, keys: jax.Array,
                             stddev: float, normalizer: float) -> jax.Array:
  """f̃ = (count + N(0, stddev²)) / normalizer + 1/2: the release."""
  draw = noise.standard_normal(keys, ())
  return (count + stddev * draw) / normalizer + 0.5


def next_clip_norm(clip_norm: jax.Array, unclipped_fraction: jax.Array,
                   target_quantile: float, learning_rate: float) -> jax.Array:
  """C · exp(-η (f̃ - γ)): down when more than γ went unclipped.

  >>> float(next_clip_norm(1.0, 0.5, 0.5, 0.2))
  1.0
  >>> round(float(next_clip_norm(1.0, 1.0, 0.5, 0.2)), 4)  # exp(-0.1)
  0.9048
  """
  return clip_norm * jnp.exp(-learning_rate
                             * (unclipped_fraction - target_quantile))


def counting(accumulate: Callable) -> Callable:
  """A step's `accumulate` clipping in units of the state's bounds
  (`clip_norms`, `{name: C}`): each example's losses scaled by 1 / C, each
  loss's centred count of unclipped examples added to
  `sums[UNCLIPPED][name]`, and the metrics (losses, norms) back in the
  loss's own units, with the `clip_norm` used."""

  def scaled(params, sums, batch, mask, step, call, clip_norms):
    sums = dict(sums)
    counts = sums.pop(UNCLIPPED)
    sums, metrics = accumulate(params, sums,
                               with_inverse_clip_norms(batch, clip_norms, mask),
                               mask, step, call, clip_norms)
    sums[UNCLIPPED] = {
        k: counts[k] + centred_count(metrics[k]["num_examples"],
                                     metrics[k]["num_clipped"])
        for k in counts}
    for k, c in clip_norms.items():
      metrics[k] = {m: v * c if m == "loss_sum" or m.startswith("grad_norm")
                    else v for m, v in metrics[k].items()}
      metrics[k]["clip_norm"] = c
    return sums, metrics

  return scaled


def adaptive_privatizer(settings: AdaptiveClipping, *,
                        sensitivities: Mapping[str, float],
                        noise_multiplier: float, normalizer: float,
                        trainable: Any = None, layouts: Any = None):
  """The release of one step's unit-space sums and counts, and the bounds
  of the next step (`settings` resolved: its `count_stddev` set).

  Each noisy sum is multiplied back by its C (post-processing); each
  loss's count gets its own noise (key stream `count_keys`); C moves
  toward the target quantile."""
  privatize = noise.privatizer(
      noise_multipliers={k: noise_multiplier for k in sensitivities},
      sensitivities=sensitivities, normalizer=normalizer, trainable=trainable,
      layouts=layouts)

  def init(params):
    return ({k: jnp.asarray(settings.initial_clip_norm, jnp.float32)
             for k in sensitivities}, None)

  def update(sums, clip_norms, noise_state, count, noise_secret):
    sums = dict(sums)
    counts = sums.pop(UNCLIPPED)
    release = privatize(sums, count, noise_secret, clip_norms)
    following = {}
    for k, name in enumerate(clip_norms):
      fraction = noisy_unclipped_fraction(
          counts[name], count_keys(noise_secret, count, k),
          settings.count_stddev, normalizer)
      following[name] = next_clip_norm(
          clip_norms[name], fraction, settings.target_quantile,
          settings.learning_rate)
    return release, following, noise_state

  return optimizers.Privatizer(init, update)


@dataclasses.dataclass(frozen=True)
class AdaptiveDPSGD(dpsgd.DPSGD):
  """DP-SGD whose bound follows a private quantile of the gradient norms."""
  name: ClassVar[str] = "adaptive_clipping"
  record_key: ClassVar[str] = "adaptive_clipping"
  setting: ClassVar[str] = "train.clip_norm = 'adaptive'"
  named: ClassVar[bool] = False

  settings: AdaptiveClipping = AdaptiveClipping()

  @classmethod
  def chosen(cls, config) -> bool:
    return config.clip_norm == ADAPTIVE

  @classmethod
  def from_config(cls, config) -> AdaptiveDPSGD:
    if config.clip_norms:
      raise errors.UsageError(
          "train.clip_norms sets fixed bounds; with train.clip_norm = "
          "'adaptive' every loss starts at adaptive_clipping.initial_clip_norm")
    return cls(dpsgd.DPSGD.from_config(config).sampling_method,
               config.adaptive_clipping or AdaptiveClipping())

  @classmethod
  def from_plan(cls, plan) -> AdaptiveDPSGD:
    return cls(plan["sampling"], AdaptiveClipping(**plan["adaptive_clipping"]))

  def resolve(self, inputs: dpsgd.PlanInputs) -> AdaptiveDPSGD:
    """The count's default noise: the expected batch / 20."""
    # q·n, float for float as the Poisson sampler has it (its resolved
    # count_stddev is part of the plan a resumed run must match)
    expected = (inputs.batch_size / inputs.n * inputs.n
                if self.sampling_method == "poisson" else inputs.batch_size)
    return dataclasses.replace(self, settings=self.settings.resolved(expected))

  def initial_clip_norm(self, clip_norm) -> float:
    return float(self.settings.initial_clip_norm)

  def step_multipliers(self, sigma, releases):
    """σ for each gradient sum, then each loss's count."""
    return ((float(sigma),) * releases
            + (self.settings.count_noise_multiplier,) * releases)

  def calibrate(self, inputs, scheme, releases):
    try:
      return super().calibrate(inputs, scheme, releases)
    except ValueError as e:
      raise errors.UsageError(
          f"no noise multiplier reaches ε = {inputs.target_epsilon} when "
          f"adaptive clipping's counts alone (noise stddev "
          f"{self.settings.count_stddev:g} examples) spend the budget: raise "
          f"adaptive_clipping.count_stddev ({e})") from None

  def record(self) -> dict:
    return dataclasses.asdict(self.settings)

  def describe_clipping(self, clip_norm, clip_norms) -> str:
    s = self.settings
    return (f"adaptive: from {s.initial_clip_norm:g} toward the "
            f"{s.target_quantile:g} quantile of the gradient norms; each step "
            "also releases its count of unclipped examples with noise "
            f"stddev {s.count_stddev:.4g}")

  def clipped_grad(self, model, *, clip_norm, bounds, method,
                   summation="auto"):
    """Each loss over its bound, clipped to 1 (sensitivity 1)."""
    if model.example_losses is None:
      loss = scaled_loss(model.example_loss, multi_loss.LOSS)
      losses = None
    else:
      loss, losses = None, scaled_losses(model.example_losses, model.loss_names)
    return multi_loss.clipped_grad(
        loss, losses, clip_norm=1.0,
        bounds=None if bounds is None else {k: 1.0 for k in bounds},
        method=method, summation=summation,
        trainable=multi_loss.trainable_mask(model))

  def accumulate(self, accumulate):
    return counting(accumulate)

  def extra_sums(self, names) -> dict:
    return {UNCLIPPED: dpsgd.zeros(names)}

  def privatizer(self, *, sensitivities, noise_multiplier, normalizer,
                 trainable=None, layouts=None):
    return adaptive_privatizer(self.settings, sensitivities=sensitivities,
                               noise_multiplier=noise_multiplier,
                               normalizer=normalizer, trainable=trainable,
                               layouts=layouts)
