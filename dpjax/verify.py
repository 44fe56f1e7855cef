"""One verification of a run's recorded state, before anything uses its ε.

Training resumes from a checkpoint, and `dpjax.export`, `dpjax.infer`, the
pipelines and `train.prior_ledger` state or compose a run's ε from one: all
of them go through `check_run` first (`newest`, `read_run`, `run_ledger` and
`inference.load_trained` call it), so no command states an ε that training
would refuse to resume from.

Formal guarantees
-----------------
A checkpoint passes `check_run` only if
  * its meta carries the MAC of the run's secret (`checkpoints.check_mac`,
    checked on every read): nothing that lacks MODEL_DIR/secret_key.json
    edited the ledger, the plan or the data position, or put another run's
    meta in its place;
  * the ledger's σ, C, δ, n, target ε, accountant, mechanism and sampling
    (q, BandMF's cycle, a shuffled epoch's length) are those of its plan;
  * its DP steps agree four ways: the ledger's, the data position's, the
    optimizer's noise counter in the state (one per release) and the
    redaction schedule's DP steps before the checkpoint's step (recomputed
    from the plan's public coins); the data position is the checkpoint's
    step and the plan's seed;
  * the ledger's events are exactly those its DP steps record under the
    plan's sampling and noise multipliers;
  * the plan's releases at σ meet its target (ε ≤ target), and a σ dpjax
    calibrated is what calibration gives for the target, δ, sampling, DP
    steps and prior releases: 0.1% less noise would exceed the target (on
    the rare accountant plateau where it would not, calibration is rerun
    and σ must be within 0.1% of its answer). A σ the user set
    (`train.noise_multiplier`) is checked against the budget alone.
Then ε recomputed from the ledger's events is the ε of the releases the
state's noise counter made at the plan's σ.

Limits: whoever can read the secret file can sign any meta, e.g. a larger σ
with a target recalibrated to it; the MAC guards against slips, scripts,
partial copies and tampering by those who cannot. The state's params are not
authenticated (only their release count is read): a replaced params file is
a different model, not a smaller ε.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, NamedTuple

import orbax.checkpoint as ocp

from dpjax.training import checkpoints, reporting
from dpjax.privacy import accounting, ledger as ledger_lib
from dpjax.privacy import mechanisms, sampling
from dpjax.privacy.mechanisms import redaction_schedule
from dpjax.privacy import secret as secret_lib

# Calibration's answer is within 1e-6 of the boundary (accounting's
# tolerance); this much less noise must exceed the target.
_SIGMA_RTOL = 1e-3
_BUDGET_RTOL = 1e-9  # the ledger's slack for a σ calibrated to the target


class UnverifiedRunError(checkpoints.CheckpointMismatchError):
  """A run's recorded state does not account for its releases."""


def _refuse(step: int, why: str) -> UnverifiedRunError:
  return UnverifiedRunError(
      f"checkpoint {step} does not account for its releases: {why}. Refusing "
      "a run whose ledger could understate ε; restore the checkpoint or use "
      "a fresh MODEL_DIR")


def dp_step_multipliers(plan: Mapping, sigma: float) -> tuple[float, ...]:
  """The noise multipliers of one DP step's releases under a plan's JSON
  (`Plan.guarantee()`): its mechanism's, e.g. σ for each clipped sum (one
  per loss), then adaptive clipping's counts (one per loss)."""
  per_step = len(plan.get("clip_norms") or {}) or 1
  return mechanisms.from_plan(plan).step_multipliers(float(sigma), per_step)


def expected_scheme(plan: Mapping):
  """The sampling scheme the plan's sampler has (its accounting)."""
  return mechanisms.from_plan(plan).scheme(int(plan["dataset_size"]),
                                           int(plan["batch_size"]))


def _planned_dp_steps(plan: Mapping) -> int:
  return int(plan["redaction"]["dp_steps"] if plan.get("redaction")
             else plan["steps"])


def check_run(meta: checkpoints.RunMeta, *, checkpoint_step: int,
              noise_count: int) -> ledger_lib.PrivacyLedger:
  """The ledger of an authenticated checkpoint's meta (`checkpoints.
  read_meta`) once it passes every check of the module docstring; else
  UnverifiedRunError naming what disagrees. `noise_count`: the optimizer's
  noise counter in the checkpoint's state."""
  step, plan = checkpoint_step, meta.plan
  try:
    ledger = meta.privacy_ledger()
    _check_parameters(step, ledger, plan, meta.sampler)
    _check_counts(step, ledger, plan, meta.data_position, noise_count)
    _check_events(step, ledger, plan)
    _check_noise(step, ledger, plan)
  except UnverifiedRunError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise _refuse(step, f"its ledger or plan is malformed ({e!r})") from None
  return ledger


def _check_parameters(step: int, ledger: ledger_lib.PrivacyLedger,
                      plan: Mapping, sampler: Mapping) -> None:
  mechanism = mechanisms.from_plan(plan).ledger_entry()
  pairs = {"σ": (ledger.noise_multiplier, float(plan["noise_multiplier"])),
           "C": (ledger.clip_norm, float(plan["clip_norm"])),
           "δ": (ledger.delta, float(plan["delta"])),
           "n": (ledger.dataset_size, int(plan["dataset_size"])),
           "target ε": (ledger.target_epsilon, float(plan["target_epsilon"])),
           "accountant": (ledger.accountant, plan["accountant"]),
           "mechanism": (ledger.mechanism, mechanism),
           "sampling": (sampling.scheme_from_description(ledger.sampling),
                        expected_scheme(plan)),
           "sampler": (ledger.sampling, dict(sampler))}
  differ = [f"{k} {got!r} in the ledger, {want!r} in the plan"
            for k, (got, want) in pairs.items() if got != want]
  if differ:
    raise _refuse(step, "; ".join(differ))


def _check_counts(step: int, ledger: ledger_lib.PrivacyLedger, plan: Mapping,
                  position: checkpoints.DataPosition, noise_count: int) -> None:
  counts = {"the ledger's DP steps": ledger.steps,
            "the data position's": position.dp_steps,
            "the optimizer's noise counter": int(noise_count),
            f"the schedule's before step {step}":
                redaction_schedule.dp_steps_before(plan, step)}
  if len(set(counts.values())) > 1:
    raise _refuse(step, ", ".join(f"{k} = {v}" for k, v in counts.items()))
  if (position.step, position.public_steps, position.seed) != (
      step, step - position.dp_steps, int(plan["seed"])):
    raise _refuse(step, f"its data position {position} is not step {step} "
                  f"with the plan's seed {plan['seed']}")
  if step > int(plan["steps"]):
    raise _refuse(step, f"the plan has {plan['steps']} steps")


def _check_events(step: int, ledger: ledger_lib.PrivacyLedger,
                  plan: Mapping) -> None:
  recorded = [e.to_json() for e in ledger.events]
  expected = [e.to_json() for e in ledger.events_for(
      ledger.steps, dp_step_multipliers(plan, ledger.noise_multiplier))]
  if recorded != expected:
    raise _refuse(step, f"its events are {recorded}, {ledger.steps} DP steps "
                  f"are {expected}")


def _check_noise(step: int, ledger: ledger_lib.PrivacyLedger,
                 plan: Mapping) -> None:
  """The plan's releases at σ meet the target; a calibrated σ is the least
  that does (module docstring)."""
  sigma, target = ledger.noise_multiplier, ledger.target_epsilon
  releases = _planned_dp_steps(plan)
  if math.isinf(target) or releases == 0:
    if sigma != 0:  # the plan adds no noise then (`plan.plan_privacy`)
      raise _refuse(step, f"σ is {sigma} where the plan adds none")
    return
  scheme = expected_scheme(plan)

  def events(s: float) -> list[accounting.Event]:
    return ledger.prior_events + scheme.events(dp_step_multipliers(plan, s),
                                               releases)

  def epsilon(s: float) -> float:
    return accounting.epsilon(events(s), ledger.delta, ledger.accountant)

  planned = epsilon(sigma)
  if planned > target * (1 + _BUDGET_RTOL):
    raise _refuse(step, f"its plan's {releases} DP steps at σ = {sigma:.6g} "
                  f"spend ε = {planned:.6g}, over the target {target:g}")
  if plan.get("noise_multiplier_given") or epsilon(
      sigma * (1 - _SIGMA_RTOL)) > target:
    return
  calibrated = accounting.calibrate_noise_multiplier(
      target, ledger.delta, events, accountant=ledger.accountant)
  if sigma > calibrated * (1 + _SIGMA_RTOL):
    raise _refuse(step, f"σ = {sigma:.6g} is not what calibration gives for "
                  f"ε = {target:g} at δ = {ledger.delta:.3g} over "
                  f"{releases} DP steps ({calibrated:.6g})")


# --- Readers of a run directory. -------------------------------------------


def meta_key(model_dir: str) -> bytes:
  """The key of the run's checkpoint MACs, from its secret file."""
  try:
    return secret_lib.RunSecret.load(model_dir).meta_key()
  except secret_lib.SecretFileError as e:
    raise UnverifiedRunError(
        f"{e}: the run's checkpoints cannot be authenticated without it"
    ) from None


def newest(mngr: ocp.CheckpointManager, key: bytes, *, params: bool = False,
           say: bool = True) -> tuple[int, checkpoints.RunMeta, Any]:
  """(step, meta, params or None) of the newest checkpoint whose meta and
  noise counter (and params, with `params`) read back and which passes
  `check_run`. Newer ones that do not read back are skipped, as training
  skips them (and named on the console with `say`); a checkpoint that reads
  back and fails a check is refused, never skipped (UnverifiedRunError,
  checkpoints.TamperedCheckpointError). None readable:
  UnreadableCheckpointError."""
  unreadable = []
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      meta = checkpoints.read_meta(mngr, step, key)
      count = checkpoints.read_noise_count(mngr, step)
      restored = checkpoints.restore_params(mngr, step) if params else None
    except checkpoints.CheckpointMismatchError:
      raise
    except Exception as e:  # any unreadable file: the previous checkpoint
      unreadable.append(f"step {step} ({checkpoints.first_line(e)})")
      continue
    check_run(meta, checkpoint_step=step, noise_count=count)
    if unreadable and say:
      reporting.say(f"{os.path.dirname(str(mngr.directory))}: checkpoint "
                    f"{', '.join(unreadable)} does not read back; using the "
                    f"previous one, step {step}")
    return step, meta, restored
  raise checkpoints.UnreadableCheckpointError(
      f"no checkpoint in {mngr.directory} reads back ("
      + ("; ".join(unreadable) or "there is none") + "). Move that directory "
      "aside to start over, or use a fresh MODEL_DIR")


class Run(NamedTuple):
  """A dpjax run's newest verified checkpoint (`read_run`)."""
  manager: ocp.CheckpointManager  # the caller closes it
  step: int
  meta: checkpoints.RunMeta


def read_run(path: str) -> Run | None:
  """(manager, step, meta) of the newest verified checkpoint of the dpjax
  run directory `path` (`newest`), or None if `path` holds no
  `checkpoints/` (e.g. a Hugging Face directory); the caller closes the
  manager."""
  if not os.path.isdir(os.path.join(path, "checkpoints")):
    return None
  mngr = checkpoints.manager(path, create=False)
  try:
    step, meta, _ = newest(mngr, meta_key(path))
  except BaseException:
    mngr.close()
    raise
  return Run(mngr, step, meta)


def run_meta(model_dir: str) -> tuple[int, checkpoints.RunMeta]:
  """(step, meta) of a run's newest verified checkpoint (`read_run`)."""
  found = read_run(model_dir)
  if found is None:
    raise checkpoints.UnreadableCheckpointError(
        f"{model_dir} holds no checkpoints/")
  found.manager.close()
  return found.step, found.meta


def run_ledger(model_dir: str) -> ledger_lib.PrivacyLedger:
  """The privacy ledger of a run, verified: its newest readable
  checkpoint's (the one source of truth; `privacy_ledger.json` is a copy),
  ε recomputed from its events."""
  return run_meta(model_dir)[1].privacy_ledger()
