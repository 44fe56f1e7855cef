"""DP-SGD, and the interface every dpjax mechanism implements.

A mechanism is one object that says, for one run, everything its guarantee
rests on, in the manner of jax-privacy's `DPExecutionPlan`:

* batch selection: `sampler` (keyed by the run's secret) and its
  accounting `scheme`; `unit` and `privacy_units` (what one neighbour
  differs by);
* the clipped gradient with its sensitivity: `clipped_grad`, and
  `accumulate` / `extra_sums` where a mechanism adds to the per-microbatch
  sums (a count released beside them);
* the noise, a transformation with its own state: `privatizer`;
* the DP event the accountant composes: each DP step is the Gaussians
  `step_multipliers(σ, releases)` on the sampler's scheme, σ from
  `calibrate`; `record` is what the checkpoint's plan keeps of the
  mechanism (so a resumed run is the same one), `ledger_entry` what the
  ledger names it.

Plan, step, loop, checkpoints and export call these and name no mechanism.
A new mechanism subclasses `DPSGD`, overrides what differs and registers
itself (`mechanisms.register`); `chosen` says which settings select it
(by default `train.mechanism = <name>`).

DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016):
Poisson-sampled (or shuffled) batches of examples, each example's gradient
clipped to C per loss, one Gaussian of multiplier σ per loss and step.

Formal guarantees
-----------------
Under Poisson sampling of rate q (add-or-remove-one adjacency) each step
is, per loss, one subsampled Gaussian mechanism with multiplier σ on the
clipped sum, whose sensitivity is its bound (`dpjax.privacy.clipping`);
under shuffling, each epoch is one Gaussian with multiplier σ/2 per example
(replace-one). The noise is keyed by (secret, release) and the batches by
the secret (`dpjax.privacy.secret`), so neither can be regenerated from the
code (`noise.privatizer`, `sampling`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from dpjax import errors
from dpjax.privacy import accounting, optimizers, sampling
from dpjax.privacy.mechanisms import multi_loss

SAMPLING_METHODS = ("poisson", "shuffle")


@dataclasses.dataclass(frozen=True)
class PlanInputs:
  """What a mechanism's choices before training may depend on (all public):
  `n` privacy units, the expected (Poisson) or exact batch, the DP steps,
  the privacy target, σ if given (`train.noise_multiplier`), the
  accountant, the releases of an earlier run on the same data it composes
  with, the Poisson overflow probability, and a resumed run's saved plan."""
  n: int
  batch_size: int
  steps: int
  delta: float
  target_epsilon: float
  noise_multiplier: float | None = None
  accountant: str = "pld"
  prior_events: Sequence[accounting.Event] = ()
  overflow_probability: float = 0.01
  saved_plan: Mapping | None = None


@dataclasses.dataclass(frozen=True)
class DPSGD:
  """DP-SGD with Gaussian noise, Poisson or shuffle sampling of examples."""
  name: ClassVar[str] = "dpsgd"
  # The plan's key for `record()`; None: the mechanism records nothing.
  record_key: ClassVar[str | None] = None
  # The setting that selects it, and what it requires: error messages.
  setting: ClassVar[str] = "train.mechanism = 'dpsgd'"
  # Selected by `train.mechanism = name` (else by its own setting).
  named: ClassVar[bool] = True
  unit: ClassVar[str] = "example"

  sampling_method: str = "poisson"

  # --- Chosen by the run's settings (`train.*`). ---------------------------

  @classmethod
  def chosen(cls, config) -> bool:
    """Whether `config` selects this mechanism."""
    return config.mechanism == cls.name

  @classmethod
  def from_config(cls, config) -> DPSGD:
    """The mechanism of `config` (one UsageError on a bad setting); choices
    that need the data are made by `resolve`."""
    if config.sampling_method not in SAMPLING_METHODS:
      raise errors.UsageError(
          "train.sampling_method must be 'poisson' or 'shuffle', got "
          f"{config.sampling_method!r}")
    return cls(config.sampling_method)

  @classmethod
  def from_plan(cls, plan: Mapping) -> DPSGD:
    """The resolved mechanism of a saved plan (`Plan.guarantee()`)."""
    return cls(plan["sampling"])

  # --- The plan. ------------------------------------------------------------

  @property
  def unit_column(self) -> str | None:
    """The task feature naming each row's privacy unit; None: the row."""
    return None

  def privacy_units(self, n: int, unit_ids: np.ndarray | None) -> int:
    """How many privacy units n rows hold."""
    return n

  def resolve(self, inputs: PlanInputs) -> DPSGD:
    """The mechanism with its choices made for this run's data."""
    return self

  def initial_clip_norm(self, clip_norm):
    """The bound of the first step, given `train.clip_norm`."""
    return clip_norm

  def sampler(self, inputs: PlanInputs, *, seed: int,
              unit_ids: np.ndarray | None = None):
    """The batch selection; `seed` must be secret
    (`RunSecret.sampling_seed()`)."""
    if self.sampling_method == "shuffle":
      return sampling.ShuffleSampler(inputs.n, inputs.batch_size, seed=seed)
    return sampling.PoissonSampler(
        inputs.n, inputs.batch_size, seed=seed,
        overflow_probability=inputs.overflow_probability)

  def scheme(self, n: int, batch_size: int):
    """The accounting of `sampler` for n units (no secret needed)."""
    if self.sampling_method == "shuffle":
      return sampling.ShuffleScheme(n // batch_size)
    return sampling.PoissonScheme(batch_size / n)

  def step_multipliers(self, sigma: float, releases: int
                       ) -> tuple[float, ...]:
    """The noise multipliers of one DP step's Gaussians on its sample: σ
    for each of its `releases` clipped sums."""
    return (float(sigma),) * releases

  def calibrate(self, inputs: PlanInputs, scheme, releases: int) -> float:
    """The least σ with which the prior events and `inputs.steps` DP steps
    of `step_multipliers(σ, releases)` on `scheme` meet the target."""
    return accounting.calibrate(
        inputs.target_epsilon, inputs.delta, scheme, [inputs.steps],
        releases_per_step=releases, accountant=inputs.accountant,
        prior_events=inputs.prior_events,
        # the step's other Gaussians, whose noise is set (not σ's)
        fixed_multipliers=self.step_multipliers(0.0, releases)[releases:])

  def record(self) -> dict | None:
    """What the checkpoint's plan keeps of the mechanism (JSON)."""
    return None

  def plan_entries(self) -> dict:
    """`{record_key: record()}`, or nothing: the plan's mechanism part."""
    record = self.record()
    return {} if record is None else {self.record_key: record}

  def ledger_entry(self) -> str | dict:
    """The ledger's `mechanism` field: its noise, DP-SGD's independent
    Gaussians (a mechanism with other noise names it)."""
    return "dpsgd"

  def note(self) -> str | None:
    """A line for the console when a new run is planned (its choices)."""
    return None

  def describe_noise(self) -> str:
    """The noise, for the plan's console line and PRIVACY.md."""
    return "DP-SGD"

  def describe_sampling(self, sampler, n: int, batch_size: int) -> str:
    """The sampling of `sampler` over n units, for the plan's console line."""
    return (f"{sampler.describe()['method']} sampling "
            f"(q={batch_size / n:.4g})")

  def describe_clipping(self, clip_norm: float,
                        clip_norms: Mapping | None) -> str:
    """The clip bound, or the per-loss `clip_norms`, in words.

    For the plan's console line and the release's privacy statement.
    """
    return str(clip_norms if clip_norms else clip_norm)

  # --- The step. ------------------------------------------------------------

  def clipped_grad(self, model, *, clip_norm: float,
                   bounds: Mapping[str, float] | None, method: str,
                   summation: str = "auto"):
    """The clipped-gradient callable of `model`'s losses, carrying each
    sum's sensitivity (`multi_loss.sensitivities`); `method` and ghost's
    `summation` as in `multi_loss.clipped_grad`."""
    return multi_loss.clipped_grad(
        model.example_loss, model.example_losses, clip_norm=clip_norm,
        bounds=bounds, method=method, summation=summation,
        trainable=multi_loss.trainable_mask(model))

  def accumulate(self, accumulate):
    """The step's `accumulate(params, sums, batch, mask, step, call,
    clip_norms) -> (sums, {name: metrics})`, with what the mechanism adds."""
    return accumulate

  def extra_sums(self, names: Sequence[str]) -> dict:
    """Accumulators beside the gradient sums (small, replicated)."""
    return {}

  def privatizer(self, *, sensitivities: Mapping[str, float],
                 noise_multiplier: float, normalizer: float,
                 trainable: Any = None,
                 layouts: Any = None) -> optimizers.Privatizer:
    """The release of one step's clipped sums: one Gaussian each.
    `trainable`: the trained-leaf mask; `layouts`: each param's logical
    axes (`noise.add_gaussian_noise` draws leaves alike together)."""
    return optimizers.gaussian_privatizer(
        noise_multipliers={k: noise_multiplier for k in sensitivities},
        sensitivities=sensitivities, normalizer=normalizer,
        trainable=trainable, layouts=layouts)


def zeros(names: Sequence[str]) -> dict:
  """`{name: 0.}`, float32: a scalar accumulator per loss."""
  return {k: jnp.zeros((), jnp.float32) for k in names}
