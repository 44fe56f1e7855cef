"""The privacy plan of a run: everything its guarantee depends on, fixed
before anything is written.

From the run's settings and the size n of its training split, the plan
gives the run's mechanism with its choices made (`dpjax.privacy.
mechanisms`), the number of steps, the sampler, δ, the redaction schedule's
public coins, the prior releases a run composes with, and the noise
multiplier σ, calibrated with dp-accounting for the target (ε, δ) over
every planned release (`accounting.calibrate`, by way of the mechanism); a
plan that would exceed its target is refused before anything is written. A
resumed run takes its plan and ledger from the checkpoint instead, which
the trainer has verified first (`dpjax.verify.check_run`), and that must be
this plan.

Nothing here imports TensorFlow or builds a model.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from dpjax.training import checkpoints, run_config
from dpjax import errors, verify
from dpjax.privacy import accounting, ledger as ledger_lib, mechanisms, sampling
from dpjax.privacy.mechanisms import redaction_schedule


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything about a run that the privacy guarantee depends on.

  `guarantee()` is what the checkpoint keeps: these fields and the
  mechanism's record (`mechanism.plan_entries()`, e.g. BandMF's strategy,
  so a resumed run uses the very same one)."""
  dataset_size: int  # privacy units: examples, or users
  batch_size: int
  steps: int
  sampling: str
  clip_norm: float  # the first step's bound
  delta: float
  target_epsilon: float
  noise_multiplier: float
  accountant: str
  seed: int  # public: init, dropout, redaction coins (not noise or batches)
  # The redaction schedule (`redaction_schedule.plan`); None: all steps DP.
  redaction: dict | None = None
  # Per-loss clip bounds of a multi-loss model (one release each per step);
  # None: one loss, one release of sensitivity `clip_norm`.
  clip_norms: dict | None = None
  mechanism: mechanisms.DPSGD = mechanisms.DPSGD()
  # σ came from `train.noise_multiplier` (e.g. a pipeline's budget split
  # over several runs), not calibrated for this plan's target alone.
  noise_multiplier_given: bool = False

  @property
  def releases_per_step(self) -> int:
    """The clipped sums released per DP step: one per loss bound."""
    return len(self.clip_norms) if self.clip_norms else 1

  @property
  def dp_steps(self) -> int:
    """The planned releases: the steps the schedule's coins made DP steps."""
    return self.redaction["dp_steps"] if self.redaction else self.steps

  def guarantee(self) -> dict:
    """What the checkpoint keeps: the fields and the mechanism's record."""
    plan = dataclasses.asdict(self)  # copies: the caller may change it
    del plan["mechanism"]  # its record, below
    for optional in ("redaction", "clip_norms"):
      if plan[optional] is None:  # as saved before they existed
        del plan[optional]
    return {**plan, **self.mechanism.plan_entries()}


def steps_for(train_steps, epochs, n, batch_size) -> int:
  """The run's steps: `train_steps`, else `epochs` passes at `batch_size`.

  Raises:
    UsageError: neither `train_steps` nor `epochs` is set.
  """
  if train_steps:
    return int(train_steps)
  if epochs:
    return math.ceil(epochs * n / batch_size)
  raise errors.UsageError("set TRAIN_STEPS or train.epochs")


def plan_privacy(sampler, *, saved_meta: dict | None, steps: int,
                 batch_size: int, sampling_method: str, clip_norm: float,
                 delta: float, target_epsilon: float,
                 noise_multiplier: float | None, accountant: str, seed: int,
                 prior: ledger_lib.PrivacyLedger | None = None,
                 redaction: dict | None = None,
                 clip_norms: Mapping[str, float] | None = None,
                 mechanism: mechanisms.DPSGD | None = None
                 ) -> tuple[ledger_lib.PrivacyLedger, Plan]:
  """The run's ledger and plan: read back from a checkpoint (whose plan must
  match this one), else with σ calibrated by dp-accounting for the target
  over all planned DP steps (or given, or 0 for ε = ∞ or when no DP step is
  planned). `prior`: the ledger of an earlier run on the same data (stage 1
  of a two-stage pipeline), whose releases this run composes with: they
  count in calibration, ε and budget. `redaction`: a redaction schedule's
  description; its `dp_steps` of the `steps` are the planned releases.
  `clip_norms`: a multi-loss model's per-loss bounds; each DP step is then
  `len(clip_norms)` Gaussians with the one σ on the same sample.
  `mechanism` (resolved; default DP-SGD with `sampling_method`): its
  `step_multipliers` are each DP step's Gaussians, σ calibrated with them.
  Raises BudgetExceededError if the recorded plus planned releases exceed
  the target.
  """
  mechanism = mechanism or mechanisms.DPSGD(sampling_method)
  prior_events = tuple(prior.all_events) if prior else ()
  releases = redaction["dp_steps"] if redaction else steps
  per_step = len(clip_norms) if clip_norms else 1
  if saved_meta:
    ledger = ledger_lib.PrivacyLedger.from_json(saved_meta["ledger"])
    sigma = ledger.noise_multiplier
  elif math.isinf(target_epsilon) or releases == 0:
    sigma = 0.0
  elif noise_multiplier is not None:
    sigma = float(noise_multiplier)
  else:
    sigma = mechanism.calibrate(
        mechanisms.PlanInputs(
            n=sampler.dataset_size, batch_size=batch_size, steps=releases,
            delta=delta, target_epsilon=target_epsilon,
            accountant=accountant, prior_events=prior_events),
        sampler.scheme, per_step)
  given = (not math.isinf(target_epsilon) and releases > 0
           and noise_multiplier is not None)
  plan = Plan(sampler.dataset_size, batch_size, steps, sampling_method,
              clip_norm, delta, target_epsilon, float(sigma), accountant, seed,
              redaction, dict(clip_norms) if clip_norms else None, mechanism,
              given)
  if saved_meta:
    checkpoints.check_compatible(saved_meta["plan"], plan.guarantee(),
                                 "privacy plan")
    _check_prior(ledger, prior)
  else:
    ledger = ledger_lib.PrivacyLedger(
        accountant=accountant, sampling=sampler.describe(),
        noise_multiplier=float(sigma), clip_norm=clip_norm,
        dataset_size=sampler.dataset_size, delta=delta,
        target_epsilon=target_epsilon, mechanism=mechanism.ledger_entry())
    if prior:
      try:
        ledger.compose_after(prior)
      except ValueError as e:
        raise errors.UsageError(f"train.prior_ledger: {e}") from None
  try:
    ledger.check_budget(ledger.planned_events(releases,
                                              plan_multipliers(plan)))
  except ledger_lib.BudgetExceededError as e:
    raise ledger_lib.BudgetExceededError(f"refusing to start: {e}") from None
  return ledger, plan


def plan_multipliers(plan: Plan) -> tuple[float, ...]:
  """The noise multipliers of one DP step's releases (the mechanism's:
  e.g. one σ for every gradient sum, then adaptive clipping's counts)."""
  return plan.mechanism.step_multipliers(plan.noise_multiplier,
                                         plan.releases_per_step)


def stages_plan(config: run_config.RunConfig, n: int,
                stage_steps: Sequence[int], target_epsilon: float,
                delta: float | None = None) -> tuple[float, float]:
  """(δ, σ) of a pipeline whose stages (e.g. a parse LM, then a
  parse-to-utterance model; an LM, then a head on it) are separate runs of
  `config`'s sampler and accountant on the same n examples, `stage_steps`
  DP steps each, under ONE σ: the least with which all of their releases
  meet (ε, δ) (`accounting.calibrate`); δ is `delta` or `config.delta`
  resolved for n.
  Each stage then trains with `train.noise_multiplier = σ` and the later
  ones with `train.prior_ledger` on the earlier, so the last ledger holds
  the pipeline's ε."""
  delta = delta or resolve_delta(config.delta, n)
  scheme = mechanisms.from_config(config).scheme(n, int(config.batch_size))
  return delta, accounting.calibrate(target_epsilon, delta, scheme,
                                     stage_steps, accountant=config.accountant)


def resolve_delta(delta: float | str | None, n: int) -> float:
  """`train.delta`: a number, '1/n', or '1/(2n)' (the default, None)."""
  if delta is None or delta == "1/(2n)":
    return 1.0 / (2 * n)
  if delta == "1/n":
    return 1.0 / n
  try:
    return float(delta)
  except ValueError:
    raise errors.UsageError(f"train.delta must be a number, '1/n' or "
                             f"'1/(2n)', got {delta!r}") from None


def read_prior_ledger(path: str | None) -> ledger_lib.PrivacyLedger | None:
  """`train.prior_ledger`: a run directory (its checkpoint's ledger) or a
  ledger file."""
  if not path:
    return None
  path = os.path.expanduser(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return verify.run_ledger(path)
  if os.path.isdir(path):
    path = os.path.join(path, ledger_lib.LEDGER_FILENAME)
  if not os.path.isfile(path):
    raise errors.UsageError(f"train.prior_ledger: no ledger at {path}")
  return ledger_lib.PrivacyLedger.load(path)


def _check_prior(ledger: ledger_lib.PrivacyLedger,
                 prior: ledger_lib.PrivacyLedger | None) -> None:
  """Refuses a checkpoint whose prior releases are not those of
  `train.prior_ledger`."""
  prior_events = [e.to_json() for e in (prior.all_events if prior else [])]
  if [e.to_json() for e in ledger.prior_events] != prior_events:
    raise verify.UnverifiedRunError(
        f"the checkpoint's ledger composes with {len(ledger.prior_events)} "
        f"prior events, train.prior_ledger gives {len(prior_events)}: "
        "resume with the train.prior_ledger the run started with")


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """What a run will do, decided before it starts (`make_plan`).

  `public[t]` says whether step t is a public step of the redaction
  schedule (all False without one); a DP step's index is its release
  number, a public step's its place in the public stream (`kind_index`).
  `ledger` is the run's ledger (the checkpoint's on resume), to which the
  loop records each release; `privacy` the plan the checkpoint keeps.
  """
  steps: int
  sampler: Any  # the mechanism's (`mechanism.sampler`)
  delta: float
  target_epsilon: float
  public: np.ndarray
  kind_index: np.ndarray
  ledger: ledger_lib.PrivacyLedger
  privacy: Plan
  planned_epsilon: float

  @property
  def noise_multiplier(self) -> float:
    """σ, the ledger's noise multiplier."""
    return self.ledger.noise_multiplier

  @property
  def noise_multipliers(self) -> tuple[float, ...]:
    """The noise multipliers of one DP step's releases."""
    return plan_multipliers(self.privacy)

  @property
  def mechanism(self) -> mechanisms.DPSGD:
    """The run's mechanism, its choices made."""
    return self.privacy.mechanism

  @property
  def normalizer(self) -> float:
    """The expected batch the noisy sum is divided by: the Poisson
    samplers' expected batch (q·n; users; q·(n // b) cyclic), else the
    batch size."""
    if isinstance(self.sampler, sampling.ShuffleSampler):
      return self.privacy.batch_size
    return self.sampler.expected_batch_size

  def dp_steps_before(self, step: int) -> int:
    """The DP steps (releases) among steps `0 .. step - 1`."""
    return int(np.count_nonzero(~self.public[:step]))

  def summary(self) -> str:
    """The plan in one console line."""
    plan, redaction = self.privacy, self.privacy.redaction
    sampling_text = self.mechanism.describe_sampling(
        self.sampler, plan.dataset_size, plan.batch_size)
    clip_text = self.mechanism.describe_clipping(plan.clip_norm,
                                                 plan.clip_norms)
    if math.isinf(self.target_epsilon) and redaction is None:
      return (f"{self.steps} steps without noise (TARGET_EPSILON = inf: "
              f"not private), {sampling_text}, C={clip_text}")
    steps = (f"{self.steps} DP steps" if redaction is None else
             f"{self.steps} steps ({redaction['schedule']} redaction "
             f"schedule): {plan.dp_steps} DP steps and "
             f"{self.steps - plan.dp_steps} public steps on "
             f"{redaction['public_task']}")
    return (f"{steps}, {self.mechanism.describe_noise()}, {sampling_text}, "
            f"σ={self.noise_multiplier:.4f}, C={clip_text}, "
            f"δ={self.delta:.3g}, planned ε={self.planned_epsilon:.4f} "
            f"(target {self.target_epsilon})")


def make_plan(config: run_config.RunConfig, *, n: int,
              sampling_seed: int, secret_source: dict,
              clip_norms: Mapping[str, float] | None = None,
              public_n: int | None = None,
              saved: checkpoints.RunMeta | None = None,
              unit_ids: np.ndarray | None = None,
              mechanism: mechanisms.DPSGD | None = None) -> RunPlan:
  """The run's plan from its settings and the data: `n` training rows (and
  `public_n` public ones with a redaction schedule; `unit_ids`, each row's
  privacy unit, where the mechanism has a `unit_column`, e.g. its user),
  the secret `sampling_seed`, a multi-loss model's per-loss bounds
  (`clip_norms`, from `multi_loss.release_bounds`), and on resume the
  checkpoint's meta, whose plan must be this one and whose ledger is taken
  over. `secret_source` is where the run's secret came from
  (`RunSecret.source`), recorded in the ledger. Raises before anything is
  written if the settings are bad or the budget would be exceeded.
  `mechanism`: the one the settings choose, if the caller has it already.
  """
  target_epsilon = run_config.check(config)
  mechanism = mechanism or mechanisms.from_config(config)
  if mechanism.unit_column is None:
    unit_ids = None
  n = mechanism.privacy_units(n, unit_ids)  # the units of privacy from here
  run_config.check_batch_size(config.batch_size, n, config.delta,
                              mechanism.unit)
  steps = steps_for(config.train_steps, config.epochs, n, config.batch_size)
  public, redaction = np.zeros(steps, bool), None  # no schedule: all DP
  if config.redaction_schedule:
    public, redaction = redaction_schedule.plan(
        config.redaction_schedule, total_steps=steps,
        eta=config.redaction_schedule_eta,
        probability=config.redaction_probability, seed=config.seed,
        public_task=config.public_task_name, public_dataset_size=public_n)
  delta = resolve_delta(config.delta, n)
  prior = read_prior_ledger(config.prior_ledger)
  inputs = mechanisms.PlanInputs(
      n=n, batch_size=config.batch_size,
      steps=redaction["dp_steps"] if redaction else steps, delta=delta,
      target_epsilon=target_epsilon, noise_multiplier=config.noise_multiplier,
      accountant=config.accountant,
      prior_events=tuple(prior.all_events) if prior else (),
      overflow_probability=config.overflow_probability,
      saved_plan=saved.plan if saved else None)
  mechanism = mechanism.resolve(inputs)
  sampler = mechanism.sampler(inputs, seed=sampling_seed, unit_ids=unit_ids)
  ledger, privacy = plan_privacy(
      sampler, saved_meta=saved.to_json() if saved else None, steps=steps,
      batch_size=config.batch_size, sampling_method=config.sampling_method,
      clip_norm=float(mechanism.initial_clip_norm(config.clip_norm)),
      delta=delta,
      target_epsilon=target_epsilon,
      noise_multiplier=config.noise_multiplier,
      accountant=config.accountant, seed=config.seed,
      prior=prior, redaction=redaction, clip_norms=clip_norms,
      mechanism=mechanism)
  ledger.secret = secret_source
  planned = accounting.epsilon(
      ledger.all_events + ledger.planned_events(
          privacy.dp_steps, plan_multipliers(privacy)),
      delta, config.accountant)
  return RunPlan(steps=steps, sampler=sampler, delta=delta,
                 target_epsilon=target_epsilon, public=public,
                 kind_index=redaction_schedule.kind_indices(public),
                 ledger=ledger, privacy=privacy, planned_epsilon=planned)
