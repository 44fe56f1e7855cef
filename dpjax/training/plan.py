"""The privacy plan of a run: everything its guarantee depends on, fixed
before anything is written.

From the run's settings and the size n of its training split, the plan
gives the number of steps, the sampler, δ, the redaction schedule's public
coins, the prior releases a run composes with, and the noise multiplier σ,
calibrated with dp-accounting for the target (ε, δ) over every planned
release (`calibrate`: the one place σ is derived, for the trainer and the
pipelines that plan several runs under one budget); a plan that would
exceed its target is refused before anything is written. A resumed run
takes its plan and ledger from the checkpoint instead, which the trainer
has verified first (`dpjax.verify.check_run`), and that must be this plan.

Nothing here imports TensorFlow or builds a model.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Mapping, Sequence

import numpy as np

from dpjax.training import checkpoints, run_config
from dpjax import errors, verify
from dpjax.privacy import accounting, ledger as ledger_lib
from dpjax.privacy import adaptive_clipping as adaptive_lib
from dpjax.privacy import bandmf as bandmf_lib
from dpjax.privacy import redaction_schedule as redaction_lib, sampling

# Seeds the public sampler apart from the secret Poisson sampler's stream.
_PUBLIC_SAMPLER_STREAM = 0x70756273  # "pubs"


def calibrate(target_epsilon: float, delta: float,
              scheme: sampling.PoissonScheme | sampling.ShuffleScheme,
              stage_steps: Sequence[int], *, releases_per_step: int = 1,
              accountant: str = "pld",
              prior_events: Sequence[accounting.Event] = (),
              fixed_multipliers: Sequence[float] = ()) -> float:
  """The smallest σ with which `prior_events` and then, for each stage, its
  steps of `releases_per_step` Gaussians (one σ for all) under the sampling
  `scheme` (a sampler's `scheme`) meet (target_epsilon, delta); 0 for ε = ∞
  or no step at all. Stages are separate runs on the same data (e.g. the LM and
  then a head on it frozen): a shuffled stage starts its own epochs.
  `fixed_multipliers`: more Gaussians of each step, on the same sample, whose
  noise is set (adaptive clipping's counts): calibrated together with σ.
  A pure function of its arguments, remembered: a pipeline (or a test
  suite) that plans the same runs again does not search again."""
  return _calibrate(float(target_epsilon), float(delta), scheme,
                    tuple(int(t) for t in stage_steps), int(releases_per_step),
                    accountant, tuple(prior_events),
                    tuple(float(s) for s in fixed_multipliers))


@functools.lru_cache(maxsize=256)
def _calibrate(target_epsilon: float, delta: float, scheme,
               stage_steps: tuple[int, ...], releases_per_step: int,
               accountant: str, prior_events: tuple[accounting.Event, ...],
               fixed_multipliers: tuple[float, ...]) -> float:
  if math.isinf(target_epsilon) or not any(stage_steps):
    return 0.0

  def events(s):
    return list(prior_events) + [
        e for steps in stage_steps
        for e in scheme.events((s,) * releases_per_step
                               + fixed_multipliers, steps)]

  return accounting.calibrate_noise_multiplier(target_epsilon, delta, events,
                                               accountant=accountant)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything about a run that the privacy guarantee depends on."""
  dataset_size: int
  batch_size: int
  steps: int
  sampling: str
  clip_norm: float
  delta: float
  target_epsilon: float
  noise_multiplier: float
  accountant: str
  seed: int  # public: init, dropout, redaction coins (not noise or batches)
  # The redaction schedule (`train`'s `redaction`); None: all steps are DP.
  redaction: dict | None = None
  # Per-loss clip bounds of a multi-loss model (one release each per step);
  # None: one loss, one release of sensitivity `clip_norm`.
  clip_norms: dict | None = None
  # `train.clip_norm = 'adaptive'`: the resolved `AdaptiveClipping` (as a
  # dict); each step also releases one noisy count per loss. `clip_norm` is
  # then the initial bound.
  adaptive_clipping: dict | None = None
  # `train.privacy_unit = 'user'`: {"user_column", "max_examples_per_user"};
  # `dataset_size` and `batch_size` then count users. None: examples.
  user_level: dict | None = None
  # `train.mechanism = 'bandmf'`: {"bands", "coefs" (the strategy, kept so
  # a resumed run uses the very same one), "candidates" (the band choice)}.
  bandmf: dict | None = None
  # σ came from `train.noise_multiplier` (e.g. a pipeline's budget split
  # over several runs), not calibrated for this plan's target alone.
  noise_multiplier_given: bool = False

  @property
  def releases_per_step(self) -> int:
    return len(self.clip_norms) if self.clip_norms else 1

  @property
  def dp_steps(self) -> int:
    """The planned releases: the steps the schedule's coins made DP steps."""
    return self.redaction["dp_steps"] if self.redaction else self.steps

  def guarantee(self) -> dict:
    plan = dataclasses.asdict(self)
    for optional in ("redaction", "clip_norms", "adaptive_clipping",
                     "user_level", "bandmf"):
      # as saved before they existed
      if plan[optional] is None:
        del plan[optional]
    return plan


def steps_for(train_steps, epochs, n, batch_size) -> int:
  if train_steps:
    return int(train_steps)
  if epochs:
    return math.ceil(epochs * n / batch_size)
  raise errors.UsageError("set TRAIN_STEPS or train.epochs")


def make_sampler(kind: str, n: int, batch_size: int, seed: int,
                 overflow_probability: float, *,
                 user_ids: np.ndarray | None = None,
                 max_examples_per_user: int | None = None):
  """The DP sampler; `seed` must be secret (`RunSecret.sampling_seed()`).
  With `user_ids` (user-level DP): Poisson sampling of `batch_size`
  expected users, at most `max_examples_per_user` examples each."""
  if user_ids is not None:
    return sampling.UserPoissonSampler(
        user_ids, batch_size, seed=seed,
        max_examples_per_user=max_examples_per_user,
        overflow_probability=overflow_probability)
  if kind == "poisson":
    return sampling.PoissonSampler(n, batch_size, seed=seed,
                                   overflow_probability=overflow_probability)
  if kind == "shuffle":
    return sampling.ShuffleSampler(n, batch_size, seed=seed)
  raise errors.UsageError(f"train.sampling_method must be 'poisson' or 'shuffle', "
                           f"got {kind!r}")


def plan_privacy(sampler, *, saved_meta: dict | None, steps: int,
                 batch_size: int, sampling_method: str, clip_norm: float,
                 delta: float, target_epsilon: float,
                 noise_multiplier: float | None, accountant: str, seed: int,
                 prior: ledger_lib.PrivacyLedger | None = None,
                 redaction: dict | None = None,
                 clip_norms: Mapping[str, float] | None = None,
                 adaptive: adaptive_lib.AdaptiveClipping | None = None,
                 user_level: dict | None = None,
                 bandmf_record: dict | None = None
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
  `adaptive`: adaptive clipping (resolved); each step also releases one
  count per loss with its `count_noise_multiplier`, and σ is calibrated
  with them.
  Raises BudgetExceededError if the recorded plus planned releases exceed
  the target.
  """
  prior_events = prior.all_events if prior else []
  releases = redaction["dp_steps"] if redaction else steps
  per_step = len(clip_norms) if clip_norms else 1
  counts = ((adaptive.count_noise_multiplier,) * per_step if adaptive
            else ())
  if saved_meta:
    ledger = ledger_lib.PrivacyLedger.from_json(saved_meta["ledger"])
    sigma = ledger.noise_multiplier
  elif math.isinf(target_epsilon) or releases == 0:
    sigma = 0.0
  elif noise_multiplier is not None:
    sigma = float(noise_multiplier)
  else:
    try:
      sigma = calibrate(target_epsilon, delta, sampler.scheme, [releases],
                        releases_per_step=per_step, accountant=accountant,
                        prior_events=prior_events, fixed_multipliers=counts)
    except ValueError as e:
      if not counts:
        raise
      raise errors.UsageError(
          f"no noise multiplier reaches ε = {target_epsilon} when adaptive "
          f"clipping's counts alone (noise stddev "
          f"{adaptive.count_stddev:g} examples) spend the budget: raise "
          f"adaptive_clipping.count_stddev ({e})") from None
  given = (not math.isinf(target_epsilon) and releases > 0
           and noise_multiplier is not None)
  plan = Plan(sampler.dataset_size, batch_size, steps, sampling_method,
              clip_norm, delta, target_epsilon, float(sigma), accountant, seed,
              redaction, dict(clip_norms) if clip_norms else None,
              dataclasses.asdict(adaptive) if adaptive else None,
              user_level, bandmf_record, given)
  if saved_meta:
    checkpoints.check_compatible(saved_meta["plan"], plan.guarantee(),
                                 "privacy plan")
    _check_prior(ledger, prior)
  else:
    ledger = ledger_lib.PrivacyLedger(
        accountant=accountant, sampling=sampler.describe(),
        noise_multiplier=float(sigma), clip_norm=clip_norm,
        dataset_size=sampler.dataset_size, delta=delta,
        target_epsilon=target_epsilon,
        mechanism=({"name": "bandmf", "bands": bandmf_record["bands"]}
                   if bandmf_record else "dpsgd"))
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
  """The noise multipliers of one DP step's releases: one σ for every
  gradient sum, then adaptive clipping's counts (one per loss)."""
  return verify.dp_step_multipliers(plan.guarantee(), plan.noise_multiplier)


def stages_plan(config: run_config.RunConfig, n: int,
                stage_steps: Sequence[int], target_epsilon: float,
                delta: float | None = None) -> tuple[float, float]:
  """(δ, σ) of a pipeline whose stages (e.g. a parse LM, then a
  parse-to-utterance model; an LM, then a head on it) are separate runs of
  `config`'s sampler and accountant on the same n examples, `stage_steps`
  DP steps each, under ONE σ: the least with which all of their releases
  meet (ε, δ) (`calibrate`); δ is `delta` or `config.delta` resolved for n.
  Each stage then trains with `train.noise_multiplier = σ` and the later
  ones with `train.prior_ledger` on the earlier, so the last ledger holds
  the pipeline's ε."""
  delta = delta or resolve_delta(config.delta, n)
  # Only the scheme: no batch is drawn, so no secret is needed.
  scheme = make_sampler(config.sampling_method, n, int(config.batch_size), 0,
                        config.overflow_probability).scheme
  return delta, calibrate(target_epsilon, delta, scheme, stage_steps,
                          accountant=config.accountant)


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


def plan_redaction(schedule: str, *, total_steps: int, eta: float,
                   probability: float | None, seed: int, public_task: str,
                   public_dataset_size: int) -> tuple[np.ndarray, dict]:
  """(public [T] bool: the redacted steps, the description the plan keeps).

  The coins are flipped here, before training, from (seed, t) alone, so the
  number of DP steps the accountant is calibrated for is exact.
  """
  try:
    probs = redaction_lib.probabilities(schedule, total_steps, eta=eta,
                                        p=probability)
  except ValueError as e:
    raise errors.UsageError(f"train.redaction_schedule: {e}") from None
  public = redaction_lib.public_steps(probs, seed)
  return public, {
      "schedule": schedule, "eta": eta, "probability": probability,
      "public_task": public_task, "public_dataset_size": public_dataset_size,
      "dp_steps": int(np.count_nonzero(~public)),
      "public_steps": int(np.count_nonzero(public))}


ADAPTIVE = "adaptive"  # train.clip_norm of adaptive clipping
PRIVACY_UNITS = ("example", "user")  # train.privacy_unit


def adaptive_settings(config: run_config.RunConfig
                      ) -> adaptive_lib.AdaptiveClipping | None:
  """The adaptive clipping of a run with `train.clip_norm = 'adaptive'`
  (its `adaptive_clipping`, else the defaults); None otherwise."""
  if config.clip_norm != ADAPTIVE:
    return None
  return config.adaptive_clipping or adaptive_lib.AdaptiveClipping()


def check_run_inputs(config: run_config.RunConfig) -> float:
  """Refuses bad values of the run's settings before anything is read or
  written: one UsageError naming the gin macro and binding. Returns the
  target ε as a float (a number or 'inf').

  `model_dir` (made absolute): must not be an existing file, and the nearest
  existing directory on its path must be writable.
  """
  model_dir = os.path.abspath(os.path.expanduser(config.model_dir))
  target_epsilon, delta = config.target_epsilon, config.delta
  batch_size, microbatch_size = config.batch_size, config.microbatch_size
  train_steps, epochs = config.train_steps, config.epochs
  clip_norm, clip_norms = config.clip_norm, config.clip_norms
  eps = run_config.as_float(target_epsilon)
  if eps is None or not eps > 0:  # NaN too
    raise errors.UsageError(
        "TARGET_EPSILON (train.target_epsilon) must be a positive number or "
        f"'inf', got {target_epsilon!r}")
  if delta is not None and delta not in ("1/n", "1/(2n)"):
    value = run_config.as_float(delta)
    if value is None or not 0 < value < 1:
      raise errors.UsageError(
          "DELTA (train.delta) must be a number strictly between 0 and 1, "
          f"'1/n' or '1/(2n)' (None: 1/(2n)), got {delta!r}")
  if not run_config.is_int(batch_size) or batch_size < 1:
    raise errors.UsageError("BATCH_SIZE (train.batch_size) must be a "
                             f"positive integer, got {batch_size!r}")
  if microbatch_size not in (None, "auto") and (
      not run_config.is_int(microbatch_size) or microbatch_size < 1):
    raise errors.UsageError(
        "MICROBATCH_SIZE (train.microbatch_size) must be a positive integer, "
        f"'auto' or None, got {microbatch_size!r}")
  buckets = config.length_buckets
  if not run_config.is_int(buckets) or buckets < 1:
    raise errors.UsageError("train.length_buckets must be a positive "
                             f"integer, got {buckets!r}")
  headroom = config.memory_headroom
  if not run_config.is_number(headroom) or not 0 < headroom <= 1:
    raise errors.UsageError("train.memory_headroom must be in (0, 1], got "
                             f"{headroom!r}")
  if train_steps is not None and (not run_config.is_int(train_steps)
                                  or train_steps < 1):
    raise errors.UsageError("TRAIN_STEPS (train.train_steps) must be a "
                             f"positive integer or None, got {train_steps!r}")
  if epochs is not None and (not run_config.is_number(epochs)
                             or not 0 < epochs < math.inf):
    raise errors.UsageError("EPOCHS (train.epochs) must be a positive "
                             f"number or None, got {epochs!r}")
  if config.mechanism not in bandmf_lib.MECHANISMS:
    raise errors.UsageError(f"train.mechanism must be one of "
                             f"{bandmf_lib.MECHANISMS}, got "
                             f"{config.mechanism!r}")
  if config.mechanism == "bandmf":
    bands = config.bands
    if bands is not None and (not run_config.is_int(bands) or bands < 1):
      raise errors.UsageError("train.bands must be a positive integer or "
                               f"None, got {bands!r}")
    clashes = {
        "train.sampling_method = 'shuffle'": config.sampling_method != "poisson",
        "train.privacy_unit = 'user'": config.privacy_unit != "example",
        "train.clip_norm = 'adaptive'": clip_norm == ADAPTIVE,
        "a redaction schedule": config.redaction_schedule is not None}
    for what, clash in clashes.items():
      if clash:
        raise errors.UsageError(
            f"train.mechanism = 'bandmf' (cyclic Poisson sampling of "
            f"examples, every step a DP step at one bound) does not combine "
            f"with {what}")
  if config.privacy_unit not in PRIVACY_UNITS:
    raise errors.UsageError(f"train.privacy_unit must be one of "
                             f"{PRIVACY_UNITS}, got {config.privacy_unit!r}")
  if config.privacy_unit == "user":
    k = config.max_examples_per_user
    if not run_config.is_int(k) or k < 1:
      raise errors.UsageError("train.max_examples_per_user must be a "
                               f"positive integer, got {k!r}")
    if config.sampling_method != "poisson":
      raise errors.UsageError(
          "train.privacy_unit = 'user' samples users by Poisson sampling: "
          f"train.sampling_method must be 'poisson', got "
          f"{config.sampling_method!r}")
    if clip_norm == ADAPTIVE:
      raise errors.UsageError(
          "train.clip_norm = 'adaptive' counts unclipped examples, not "
          "users: use a fixed CLIP_NORM with train.privacy_unit = 'user'")
  if clip_norm == ADAPTIVE:
    clip_norm = adaptive_settings(config).initial_clip_norm
    if clip_norms:
      raise errors.UsageError(
          "train.clip_norms sets fixed bounds; with train.clip_norm = "
          "'adaptive' every loss starts at adaptive_clipping.initial_clip_norm")
  for name, c in [("CLIP_NORM (train.clip_norm)", clip_norm),
                  *((f"train.clip_norms[{k!r}]", v)
                    for k, v in dict(clip_norms or {}).items())]:
    if not run_config.is_number(c) or not 0 < c < math.inf:
      raise errors.UsageError(f"{name} must be a positive finite number, "
                               f"got {c!r}")
  if os.path.lexists(model_dir) and not os.path.isdir(model_dir):
    raise errors.UsageError(f"MODEL_DIR (train.model_dir) {model_dir} exists "
                             "and is not a directory")
  existing = model_dir
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise errors.UsageError(f"MODEL_DIR (train.model_dir) {model_dir}: "
                             f"{existing} is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise errors.UsageError(
        f"MODEL_DIR (train.model_dir) {model_dir} is not writable: no write "
        f"permission on {existing}")
  if (config.public_task_name is None) != (config.redaction_schedule is None):
    raise errors.UsageError(
        "train.public_task_name and train.redaction_schedule go together: "
        f"got {config.public_task_name!r} and {config.redaction_schedule!r}")
  return eps


def check_batch_size(batch_size: int, n: int, delta=None,
                     unit: str = "example") -> None:
  """BATCH_SIZE against the n examples (or users) of the training split
  (and δ = '1/n' of a one-unit set); a UsageError naming both."""
  if n < 1:
    raise errors.UsageError(f"the training split has no {unit}s (n = 0): "
                             "check the task's training data")
  if batch_size > n:
    raise errors.UsageError(
        f"BATCH_SIZE (train.batch_size) = {batch_size} must be <= the number "
        f"of training {unit}s n = {n}")
  if delta == "1/n" and n < 2:
    raise errors.UsageError(f"DELTA (train.delta) = '1/n' is 1 for a "
                             f"one-{unit} training set: set a number < 1")


def public_sampler(n: int, batch_size: int, seed: int
                    ) -> sampling.ShuffleSampler:
  """Shuffled batches of exactly BATCH_SIZE public rows. Public data needs no
  Poisson sampling; its seed is drawn apart from the run's so that public
  batches say nothing about the secret Poisson samples."""
  public_seed = int(np.random.SeedSequence(
      [seed, _PUBLIC_SAMPLER_STREAM]).generate_state(1)[0])
  try:
    return sampling.ShuffleSampler(n, batch_size, seed=public_seed)
  except ValueError as e:
    raise errors.UsageError(f"train.public_task_name: {e}") from None


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
  sampler: (sampling.PoissonSampler | sampling.UserPoissonSampler
            | sampling.CyclicPoissonSampler | sampling.ShuffleSampler)
  delta: float
  target_epsilon: float
  public: np.ndarray
  kind_index: np.ndarray
  ledger: ledger_lib.PrivacyLedger
  privacy: Plan
  planned_epsilon: float

  @property
  def noise_multiplier(self) -> float:
    return self.ledger.noise_multiplier

  @property
  def noise_multipliers(self) -> tuple[float, ...]:
    """The noise multipliers of one DP step's releases."""
    return plan_multipliers(self.privacy)

  @property
  def strategy(self) -> bandmf_lib.Strategy | None:
    """BandMF's strategy (`train.mechanism = 'bandmf'`), else None."""
    record = self.privacy.bandmf
    return None if record is None else bandmf_lib.Strategy(
        tuple(record["coefs"]), self.privacy.dp_steps)

  @property
  def adaptive_clipping(self) -> adaptive_lib.AdaptiveClipping | None:
    """The run's adaptive clipping (resolved), None with fixed bounds."""
    settings = self.privacy.adaptive_clipping
    return None if settings is None else adaptive_lib.AdaptiveClipping(
        **settings)

  @property
  def normalizer(self) -> float:
    """The expected batch the noisy sum is divided by: the Poisson
    samplers' expected batch (q·n; users; q·(n // b) cyclic), else the
    batch size."""
    if isinstance(self.sampler, sampling.ShuffleSampler):
      return self.privacy.batch_size
    return self.sampler.expected_batch_size

  def dp_steps_before(self, step: int) -> int:
    return int(np.count_nonzero(~self.public[:step]))

  def summary(self) -> str:
    """The plan in one console line."""
    plan, redaction = self.privacy, self.privacy.redaction
    if math.isinf(self.target_epsilon) and redaction is None:
      return (f"{self.steps} steps without noise (TARGET_EPSILON = inf: "
              f"not private), {self._sampling_summary()}, "
              f"C={self._clip_summary()}")
    steps = (f"{self.steps} DP steps" if redaction is None else
             f"{self.steps} steps ({redaction['schedule']} redaction "
             f"schedule): {plan.dp_steps} DP steps and "
             f"{self.steps - plan.dp_steps} public steps on "
             f"{redaction['public_task']}")
    mf = plan.bandmf
    noise = f"BandMF noise ({mf['bands']} bands), " if mf else ""
    return (f"{steps}, {noise}{self._sampling_summary()}, "
            f"σ={self.noise_multiplier:.4f}, "
            f"C={self._clip_summary()}, "
            f"δ={self.delta:.3g}, planned ε={self.planned_epsilon:.4f} "
            f"(target {self.target_epsilon})")

  def _sampling_summary(self) -> str:
    plan = self.privacy
    if plan.bandmf:
      return (f"cyclic Poisson sampling (q={self.sampler.sampling_rate:.4g} "
              f"of n // {plan.bandmf['bands']})")
    q = plan.batch_size / plan.dataset_size
    if plan.user_level:
      return (f"Poisson sampling of users (q={q:.4g} of {plan.dataset_size} "
              f"users, <= {plan.user_level['max_examples_per_user']} "
              "examples each)")
    return f"{self.sampler.describe()['method']} sampling (q={q:.4g})"

  def _clip_summary(self) -> str:
    plan, adaptive = self.privacy, self.adaptive_clipping
    if adaptive is None:
      return str(plan.clip_norms if plan.clip_norms else plan.clip_norm)
    return (f"adaptive (from {adaptive.initial_clip_norm:g} toward the "
            f"{adaptive.target_quantile:g} quantile, count noise "
            f"{adaptive.count_stddev:.4g})")


def plan_bandmf(config: run_config.RunConfig, *, n: int, steps: int,
                delta: float, target_epsilon: float,
                prior: ledger_lib.PrivacyLedger | None,
                saved_plan: dict | None) -> dict:
  """BandMF's strategy for a run of `steps` DP steps on n examples: the
  checkpoint's on resume; else jax-privacy's optimised strategy of
  `train.bands` bands or, by default, of the band count whose error at the
  σ calibrated for the target (cyclic Poisson, cycle = bands) is least."""
  if saved_plan and saved_plan.get("bandmf"):
    return saved_plan["bandmf"]
  if config.bands is not None and config.bands > bandmf_lib.max_bands(
      steps, n, config.batch_size):
    raise errors.UsageError(
        f"train.bands = {config.bands}: each example must be eligible only "
        f"every bands-th step, so bands <= min(n // BATCH_SIZE = "
        f"{n // config.batch_size}, steps = {steps})")
  if config.bands is not None:
    strategy = bandmf_lib.optimized_strategy(steps, config.bands)
    return {"bands": strategy.bands, "coefs": list(strategy.coefs),
            "candidates": [{"bands": strategy.bands}]}
  if math.isinf(target_epsilon) or config.noise_multiplier is not None:
    raise errors.UsageError(
        "train.mechanism = 'bandmf' chooses its bands at the σ calibrated for "
        "a finite TARGET_EPSILON: with train.noise_multiplier or ε = inf, "
        "set train.bands")
  prior_events = prior.all_events if prior else []

  def noise_multiplier(bands: int) -> float:
    scheme = sampling.PoissonScheme(config.batch_size / (n // bands),
                                    cycle_length=bands)
    return calibrate(target_epsilon, delta, scheme, [steps],
                     accountant=config.accountant, prior_events=prior_events)

  strategy, _, rows = bandmf_lib.choose_bands(
      steps, bandmf_lib.band_candidates(steps, n, config.batch_size),
      noise_multiplier)
  return {"bands": strategy.bands, "coefs": list(strategy.coefs),
          "candidates": rows}


def make_plan(config: run_config.RunConfig, *, n: int,
              sampling_seed: int, secret_source: dict,
              clip_norms: Mapping[str, float] | None = None,
              public_n: int | None = None,
              saved: checkpoints.RunMeta | None = None,
              user_ids: np.ndarray | None = None) -> RunPlan:
  """The run's plan from its settings and the data: `n` training examples
  (and `public_n` public ones with a redaction schedule; `user_ids`, each
  example's user, with `train.privacy_unit = 'user'`), the secret
  `sampling_seed`, a multi-loss model's per-loss bounds (`clip_norms`,
  from `steps.loss_clip_norms`), and on resume the checkpoint's meta, whose
  plan must be this one and whose ledger is taken over. `secret_source`
  is where the run's secret came from (`RunSecret.source`), recorded in
  the ledger. Raises before anything is written if the settings are bad or
  the budget would be exceeded.
  """
  target_epsilon = check_run_inputs(config)
  user_level = None
  if config.privacy_unit == "user":
    if user_ids is None or len(user_ids) != n:
      raise ValueError("train.privacy_unit = 'user' needs each of the n "
                       "examples' user ids")
    user_level = {"user_column": config.user_column,
                  "max_examples_per_user": int(config.max_examples_per_user)}
    n = int(np.unique(user_ids).size)  # the units of privacy from here on
  else:
    user_ids = None
  check_batch_size(config.batch_size, n, config.delta, config.privacy_unit)
  steps = steps_for(config.train_steps, config.epochs, n, config.batch_size)
  delta = resolve_delta(config.delta, n)
  prior = read_prior_ledger(config.prior_ledger)
  bandmf_record = None
  if config.mechanism == "bandmf":
    bandmf_record = plan_bandmf(
        config, n=n, steps=steps, delta=delta, target_epsilon=target_epsilon,
        prior=prior, saved_plan=saved.plan if saved else None)
    sampler = sampling.CyclicPoissonSampler(
        n, config.batch_size, cycle_length=bandmf_record["bands"],
        steps=steps, seed=sampling_seed,
        overflow_probability=config.overflow_probability)
  else:
    sampler = make_sampler(config.sampling_method, n, config.batch_size,
                           sampling_seed, config.overflow_probability,
                           user_ids=user_ids,
                           max_examples_per_user=config.max_examples_per_user)
  adaptive = adaptive_settings(config)
  if adaptive is not None:  # the count's default noise: expected batch / 20
    adaptive = adaptive.resolved(
        sampler.sampling_rate * n if isinstance(
            sampler, sampling.PoissonSampler) else config.batch_size)
  public, redaction = np.zeros(steps, bool), None  # no schedule: all DP
  if config.redaction_schedule:
    public, redaction = plan_redaction(
        config.redaction_schedule, total_steps=steps,
        eta=config.redaction_schedule_eta,
        probability=config.redaction_probability, seed=config.seed,
        public_task=config.public_task_name, public_dataset_size=public_n)
  ledger, privacy = plan_privacy(
      sampler, saved_meta=saved.to_json() if saved else None, steps=steps,
      batch_size=config.batch_size, sampling_method=config.sampling_method,
      clip_norm=float(adaptive.initial_clip_norm if adaptive
                      else config.clip_norm), delta=delta,
      target_epsilon=target_epsilon,
      noise_multiplier=config.noise_multiplier,
      accountant=config.accountant, seed=config.seed,
      prior=prior, redaction=redaction, clip_norms=clip_norms,
      adaptive=adaptive, user_level=user_level, bandmf_record=bandmf_record)
  ledger.secret = secret_source
  planned = accounting.epsilon(
      ledger.all_events + ledger.planned_events(
          privacy.dp_steps, plan_multipliers(privacy)),
      delta, config.accountant)
  return RunPlan(steps=steps, sampler=sampler, delta=delta,
                 target_epsilon=target_epsilon, public=public,
                 kind_index=redaction_lib.kind_indices(public), ledger=ledger,
                 privacy=privacy, planned_epsilon=planned)
