"""DP training of a T5 or GPT-2 model on a seqio task (`python -m dpjax.train`).

  python -m dpjax.train --gin_file=gin/msmarco_t5_xl_eps3.gin \\
      --gin.MODEL_DIR=/runs/xl_eps3 [--gin.NAME=VALUE ...]

A run is plan -> step -> loop. The plan (`dpjax.training.plan.make_plan`,
from the typed `RunConfig` and the data) is made before anything is
written: the data is loaded and counted, the mechanism chosen
(`dpjax.privacy.mechanisms`) and its sampler fixed, the noise multiplier
calibrated with dp-accounting for the target (ε, δ) over all planned steps,
and a run that would exceed its budget refuses to start. The steps
(`dpjax.training.step`: one jit-compiled DP step per logical batch) are
placed on the mesh, and the loop (`dpjax.training.loop.fit`) runs them, its callbacks writing
eval loss, TensorBoard summaries, a console progress line and orbax
checkpoints (`dpjax.training.checkpoints`) that carry the privacy ledger and resume
exactly: batches and noise are pure functions of (secret, step), where the
secret is the run's 256 bits of OS entropy (`privacy.secret`, in
MODEL_DIR/secret_key.json, never published); `train.seed` keys only what the
guarantee does not rest on (initialisation, dropout, the redaction coins).

With `train.public_task_name` and `train.redaction_schedule` the run follows a
redaction schedule (dpjax.privacy.mechanisms.redaction_schedule, Kabra & Elenberg,
Findings of EMNLP 2023, arXiv 2305.14208): each step is, by a public coin
flipped before training, either a DP step on the original task or a non-private
step on the public (redacted) task, both updating one optimizer state. Only the
DP steps are releases: σ is calibrated for exactly their number, and only they
enter the ledger. A finished dpjax run directory is also a valid
INITIAL_CHECKPOINT_PATH, e.g. JFT: a DP run started from a run trained on
redacted data. Its model must be this run's, or a field of this run's config
(the GPT-2 that a GPT-2 + discriminator head extends, the post-hoc head of the
ICLR 2023 submission on conditional generation); the top-level param subtrees
its checkpoint lacks (the head) are freshly initialised, and said so.

A model with several named per-example losses makes one release per loss
each step, each clipped to its own bound (`mechanisms.multi_loss`).

The same command runs on every host of a multi-host job (dpjax.training.distributed):
each process reads only the sampled rows its devices hold, process 0 alone
writes the console, summaries and ledger file, and a SIGTERM reaching any host
checkpoints all of them at one step boundary.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from dpjax.training import (checkpoints, distributed, loop, padding,
                            partitioning, plan as plan_lib, prefetch,
                            reporting, run_config, sizing as sizing_lib,
                            step as step_lib, targets)
from dpjax.training import optimizer as optimizer_lib
from dpjax.training.state import TrainState
from dpjax import errors, fileio, pretrained, verify
from dpjax.models import trainable as trainable_lib
from dpjax.privacy import clipping_method as clipping_lib
from dpjax.privacy import ledger as ledger_lib
from dpjax.privacy import mechanisms, sampling, secret as secret_lib
from dpjax.privacy.mechanisms import multi_loss, redaction_schedule

RunConfig = run_config.RunConfig


class Built(NamedTuple):
  """A run assembled before anything is written (`build`): its data, plan,
  sizing and steps placed on the mesh, not yet initialised."""
  config: RunConfig
  model_dir: str
  target_epsilon: float
  model: trainable_lib.Trainable
  lengths: dict
  splits: "_Splits"
  tokenizer: dict | None
  init_run: verify.Run | None  # INITIAL_CHECKPOINT_PATH's, if a dpjax run
  mngr: Any  # the existing run's orbax manager, or None
  resume: verify.Run | None  # the newest readable checkpoint here
  run_secret: secret_lib.RunSecret
  plan: plan_lib.RunPlan
  plan_for: Callable  # saved RunMeta | None -> RunPlan
  mesh: Any
  rules: Any
  sizing: sizing_lib.Choice
  sizing_key: str | None  # an automatic choice's fingerprint, to record
  placed: step_lib.PlacedSteps
  schedule: Any
  batch_rows: dict  # one training example's features, as abstract shapes
  # model config -> its steps placed like `placed` (the run's mesh, plan and
  # optimizer): a dry run costs a scanned model's layers through it.
  place_model: Callable[[Any], step_lib.PlacedSteps]


def build(config: RunConfig, *, dry_run: bool = False,
          target: targets.Target | None = None,
          canaries: Callable | None = None,
          added_rows: Callable | None = None) -> Built:
  """Everything a run needs before its first write: inputs checked, data
  loaded, plan made (σ calibrated, budget checked), microbatch and remat
  sized, steps placed. With `dry_run` nothing is ever written: a new run's
  secret is drawn and kept in memory only. `canaries` (an audit's,
  `dpjax.audit`): `(model, plan) -> GradientCanaries` that the releases
  carry; `added_rows` (an input audit's): `(train arrays, noise secret) ->
  rows` appended to the training split, each a privacy unit of its own.
  `target` (a dry run's): the mesh
  is over its devices and sized to its memory (`dpjax.training.targets`)."""
  if target is not None and not dry_run:
    raise ValueError("a compile target is for dry runs: its devices are "
                     "not this host's")
  model_dir = os.path.abspath(os.path.expanduser(config.model_dir))
  target_epsilon = run_config.check(config)
  mechanism = mechanisms.from_config(config)

  # --- The run already here: its secret, its state verified. ---------------
  mngr = _existing_manager(model_dir, config.keep_checkpoints)
  resuming = bool(mngr and mngr.all_steps())
  if dry_run and not secret_lib.exists(model_dir):
    run_secret = (secret_lib.RunSecret.pinned(config.pinned_secret_seed)
                  if config.pinned_secret_seed is not None
                  else secret_lib.RunSecret.draw())
  else:
    run_secret = _run_secret(model_dir, resuming=resuming,
                             pinned_seed=config.pinned_secret_seed)
  resume = _verified_resume(mngr, run_secret, model_dir) if resuming else None

  # --- Data: validated before anything is written. -------------------------
  init_run = (verify.read_run(os.path.expanduser(
      config.initial_checkpoint_path)) if config.initial_checkpoint_path
              else None)
  tokenizer = initial_tokenizer_files(config.initial_checkpoint_path,
                                      config.initial_checkpoint_base_path)
  lengths = dict(config.task_feature_lengths)
  model_config = config.model_config
  try:  # the data layer needs the model's converter, not its remat
    model = trainable_lib.trainable(
        sizing_lib.with_remat(model_config, "none"), lengths)
  except (TypeError, KeyError) as e:
    raise errors.UsageError(f"train.model_config / TASK_FEATURE_LENGTHS: {e}")
  if init_run:  # a dpjax run directory (e.g. JFT's stage 1): the same model,
    # or the one this model extends (`checkpoints.init_from_run`)
    checkpoints.check_initialises(init_run.meta, model_config)
  splits = _load_splits(
      config, model, lengths, mechanism,
      added_rows and (lambda train: added_rows(train, run_secret.noise_key())))
  n = len(splits.tokens)

  # --- Plan: resume the ledger or calibrate σ; refuse to overspend. --------
  bounds = multi_loss.release_bounds(  # each loss's first bound
      model, mechanism.initial_clip_norm(config.clip_norm), config.clip_norms)

  def plan_for(saved: checkpoints.RunMeta | None) -> plan_lib.RunPlan:
    return plan_lib.make_plan(
        config, n=n, sampling_seed=run_secret.sampling_seed(),
        secret_source=run_secret.source, clip_norms=bounds,
        public_n=(None if splits.public is None
                  else len(splits.public_tokens)),
        saved=saved, unit_ids=splits.units, mechanism=mechanism)

  plan = plan_for(resume.meta if resume else None)
  if resume:
    checkpoints.check_model(resume.meta, model_config)
  reporting.say(plan.summary())
  if plan.mechanism.note() and not resume:
    reporting.say(plan.mechanism.note())
  if run_secret.is_pinned:
    reporting.say(
        "WARNING: the noise and batches are pinned (train.pinned_secret_seed):"
        " whoever knows the seed can regenerate them, and this run's (ε, δ) "
        "does not hold against them; the ledger records the secret as pinned")

  # --- Steps on the mesh, sized to the device. ------------------------------
  mesh = partitioning.make_mesh(config.mesh_shape,
                                devices=target and target.devices)
  rules = partitioning.logical_axis_rules(config.axis_rules)
  schedule = (config.learning_rate if config.learning_rate is not None else
              optimizer_lib.learning_rate_schedule(
                  config.learning_rate_schedule, total_steps=plan.steps))

  audit_canaries = canaries and canaries(model, plan)

  def place(variant: sizing_lib.Variant, model_config=model_config
            ) -> tuple[trainable_lib.Trainable, step_lib.PlacedSteps]:
    sized = trainable_lib.trainable(
        sizing_lib.with_remat(model_config, variant.remat), lengths)
    return sized, step_lib.place_steps(
        sized, plan.mechanism, mesh=mesh, rules=rules,
        optimizer=config.optimizer, learning_rate=schedule,
        clip_norm=plan.privacy.clip_norm, clip_norms=bounds,
        normalizer=plan.normalizer, seed=config.seed,
        clipping_method=config.clipping_method,
        ghost_summation=variant.summation, canaries=audit_canaries)

  rows = {f: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
          for f, x in splits.train.items()}
  choice, key = sizing_lib.size_steps(
      config, plan.sampler.max_batch_size, mesh=mesh, rules=rules, rows=rows,
      place=lambda *args: place(*args)[1], model_dir=model_dir,
      dry_run=dry_run, target=target,
      ghost=_book_keeps_under_remat(config, lengths, rows))
  chosen = sizing_lib.Variant(choice.remat or "none",
                              choice.ghost_summation or config.ghost_summation)
  model, placed = place(chosen)
  return Built(
      config=config, model_dir=model_dir, target_epsilon=target_epsilon,
      model=model, lengths=lengths, splits=splits, tokenizer=tokenizer,
      init_run=init_run, mngr=mngr, resume=resume, run_secret=run_secret,
      plan=plan, plan_for=plan_for, mesh=mesh, rules=rules, sizing=choice,
      sizing_key=key, placed=placed, schedule=schedule, batch_rows=rows,
      place_model=lambda other: place(chosen, other)[1])


def clipping_of(model: trainable_lib.Trainable, rows: dict, method: str,
                summation: str) -> tuple[str, str | None]:
  """The clipping `model`'s step uses by `train.clipping_method` `method`
  ('auto' resolved), and with ghost clipping how it forms the sum from
  `train.ghost_summation` `summation` ('book_keeping' | 'second_pass');
  `rows`: one example's abstract features. A ValueError where
  'book_keeping' cannot record a site's factors."""
  if method == "auto" and model.example_losses is not None:
    return "vmap", None  # several losses: by vmap only (multi_loss.clipped_grad)
  example = dict(rows)
  if model.example_rng:
    example["dropout_rng"] = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  abstract = model.abstract_params()[0]
  return clipping_lib.resolution(
      model.example_loss, abstract, example, method, summation,
      trainable=model.trainable_mask and model.trainable_mask(abstract))


def _book_keeps_under_remat(config: RunConfig, lengths, rows) -> bool:
  """Whether the run is sized (microbatch or remat 'auto') and clips by
  ghost with its summation left to 'auto' and every site's factors
  recordable under layer remat: then the sizing compares book-keeping with
  the second pass there."""
  remat = sizing_lib.model_remat(config.model_config)
  if (config.ghost_summation != "auto" or remat not in (sizing_lib.AUTO,
                                                        "layer")
      or sizing_lib.AUTO not in (config.microbatch_size, remat)):
    return False
  model = trainable_lib.trainable(
      sizing_lib.with_remat(config.model_config, "layer"), lengths)
  try:
    return clipping_of(model, rows, config.clipping_method,
                       "book_keeping")[0] == "ghost"
  except ValueError:  # a site book-keeping cannot record
    return False


def train(config: RunConfig, *,
          config_text: Callable[[], str] | None = None,
          canaries: Callable | None = None,
          added_rows: Callable | None = None,
          callbacks: Sequence[loop.Callback] = ()) -> dict:
  """Runs (or resumes) one DP training job; returns a summary dict.

  Args:
    config: The run's settings; see `RunConfig` for each, the module
      docstring for what a run does.
    config_text: Gives the configuration's text, written as MODEL_DIR/
      config.gin once the data is loaded (a command line's gin operative
      config, which `dpjax.infer` reads back); None: no config.gin.
    canaries, added_rows: An audit's canaries (`build`).
    callbacks: More `loop.fit` callbacks, after the run's own.
  """
  distributed.initialize()  # before any other JAX use; single process: no-op
  wall_start = time.perf_counter()
  built = build(config, canaries=canaries, added_rows=added_rows)
  start_step, state, plan, mngr = _start(built)
  _write_run_files(built.model_dir, built.run_secret, plan.ledger, config_text)
  reporting.log_libraries_to(built.model_dir)
  if built.sizing_key and distributed.is_primary():
    sizing_lib.save(built.model_dir, built.sizing_key, built.sizing)

  noise_secret = distributed.global_array(
      built.run_secret.noise_key(), partitioning.replicated(built.mesh))
  step_fn = step_function(plan, built.placed, built.splits, mesh=built.mesh,
                          rules=built.rules, m=built.sizing.microbatch_size,
                          k=built.sizing.accumulation_steps,
                          noise_secret=noise_secret)
  summaries = reporting.Summaries(built.model_dir)
  reporter = loop.Reporter(
      period=config.log_period, ledger=plan.ledger, summaries=summaries,
      progress=reporting.Progress(plan.steps, start_step),
      target_epsilon=built.target_epsilon, schedule=built.schedule,
      mixed=bool(config.redaction_schedule))
  evaluator = _evaluator(built, summaries)
  checkpointer = loop.Checkpointer(
      period=config.checkpoint_period, manager=mngr,
      model_dir=built.model_dir, meta=lambda step: _run_meta(built, plan, step),
      key=built.run_secret.meta_key())
  callbacks = [*(c for c in (reporter, evaluator, checkpointer) if c),
               *callbacks]
  try:
    with distributed.preemption_watch() as preempted:
      state, done = loop.fit(state, step_fn, start_step=start_step,
                             end_step=plan.steps, callbacks=callbacks,
                             should_stop=preempted)
  finally:  # a failed save too: a long job trains many runs in one process
    summaries.close()
    mngr.close()  # orbax's threads and event loops
  if done < plan.steps:  # said by every process, in every host's log
    print(f"dpjax: SIGTERM: checkpointed step {done}; rerun the same "
          "command to resume", flush=True)
  result = {**reporter.last,
            "wall_seconds": time.perf_counter() - wall_start}
  if evaluator and evaluator.last_loss is not None:
    result["eval_loss"] = evaluator.last_loss
  return _finish(built, plan, done, result)


def _start(built: Built) -> tuple[int, TrainState, plan_lib.RunPlan, Any]:
  """The state to train from: the newest checkpoint restored straight into
  place (any saved mesh: re-sharded) with the plan its ledger gives, or a new
  state built in place on the mesh, the same on every process. Returns
  (start step, state, plan, checkpoint manager)."""
  config, placed, plan = built.config, built.placed, built.plan
  if built.resume:
    start_step, state, saved = checkpoints.restore_newest(
        built.mngr, placed.abstract_state, built.model_dir,
        built.run_secret.meta_key())
    if start_step != built.resume.step:  # newer ones unreadable: its ledger
      verify.check_run(saved, checkpoint_step=start_step,
                       noise_count=int(state.noise_count))
      plan = built.plan_for(saved)
    reporting.say(f"resumed {built.model_dir} at step {start_step}, "
                  f"ε spent {plan.ledger.epsilon_spent():.4f}")
    mngr = built.mngr
  else:
    params = _initial_params(config, built.model, built.init_run,
                             placed.state_shardings.params)
    start_step = 0
    state = placed.init(params)
    mngr = built.mngr or checkpoints.manager(
        built.model_dir, max_to_keep=config.keep_checkpoints)
  if built.init_run:  # read; orbax's threads need not live through the run
    built.init_run.manager.close()
  return start_step, state, plan, mngr


def _run_meta(built: Built, plan: plan_lib.RunPlan,
              step: int) -> checkpoints.RunMeta:
  """What a checkpoint at `step` records beside the state: the ledger, the
  plan, the model and where the data stream stands."""
  config = built.config
  dp_steps = plan.dp_steps_before(step)
  return checkpoints.RunMeta(
      ledger=plan.ledger.to_json(), plan=plan.privacy.guarantee(),
      model_class=type(config.model_config).__name__,
      model_config=checkpoints.config_json(config.model_config),
      data_position=checkpoints.DataPosition(
          step=step, seed=config.seed, dp_steps=dp_steps,
          public_steps=step - dp_steps),
      sampler=plan.sampler.describe(),
      mixture_or_task_name=config.mixture_or_task_name,
      task_feature_lengths=built.lengths,
      initial_checkpoint_path=config.initial_checkpoint_path,
      tokenizer_files=built.tokenizer or {})


def _evaluator(built: Built, summaries) -> loop.Evaluator | None:
  """The held-out loss every `eval_period` steps, or None without one."""
  config = built.config
  if not config.eval_period:
    return None
  from dpjax.data import arrays as data_arrays  # TF: the DP core needs none
  eval_data = data_arrays.load_task_arrays(
      config.mixture_or_task_name, config.eval_split, built.lengths,
      converter=built.model.converter)
  return loop.Evaluator(
      period=config.eval_period, summaries=summaries,
      evaluate=_eval_loss_fn(built.placed.eval, eval_data, built.mesh,
                             built.rules, built.sizing.microbatch_size,
                             config.eval_examples))


def _finish(built: Built, plan: plan_lib.RunPlan, done: int,
            result: dict) -> dict:
  """Says where the run stopped and what it spent; writes and returns the
  summary (`result` holds the last step's metrics)."""
  ledger, eps = plan.ledger, plan.ledger.epsilon_spent()
  result = {"model_dir": built.model_dir, "steps": plan.steps,
            "steps_done": done, "epsilon_spent": eps,
            "target_epsilon": built.target_epsilon, "delta": plan.delta,
            "noise_multiplier": plan.noise_multiplier, **result,
            "dp_steps": ledger.steps, "public_steps": done - ledger.steps}
  spent = (f"({ledger.steps} DP steps): ε spent {eps:.4f} of "
           f"{built.target_epsilon} (δ={plan.delta:.3g})"
           if math.isfinite(built.target_epsilon) else "without noise (ε = ∞)")
  reporting.say(
      f"{'trained' if done == plan.steps else 'stopped'} {built.model_dir} at "
      f"step {done}/{plan.steps} {spent}; checkpoints in "
      f"{os.path.join(built.model_dir, 'checkpoints')}, privacy ledger in "
      f"{os.path.join(built.model_dir, ledger_lib.LEDGER_FILENAME)}")
  if distributed.is_primary():
    fileio.write_atomic(os.path.join(built.model_dir, "train_summary.json"),
                        json.dumps(result, indent=2, default=str))
  return result


class _Splits(NamedTuple):
  """The training split (feature arrays and each row's real tokens) and, with
  a redaction schedule, the public split and its shuffled sampler."""
  train: dict
  tokens: np.ndarray
  units: np.ndarray | None = None  # each row's privacy unit (e.g. user)
  public: dict | None = None
  public_tokens: np.ndarray | None = None
  public_sampler: sampling.ShuffleSampler | None = None
  # train.trim_padding: the training rows of a microbatch, cut to a few
  # bucket widths (`padding.Trimmer`).
  trim: padding.Trimmer | None = None


def _load_splits(config: RunConfig, model: trainable_lib.Trainable,
                 lengths: dict, mechanism: mechanisms.DPSGD,
                 added_rows: Callable | None = None) -> _Splits:
  """The run's splits, checked (registered tasks, the model's features, a
  batch no larger than the data) before anything is written; `added_rows`:
  `train arrays -> rows` appended to the training split (`build`)."""
  from dpjax.data import arrays as data_arrays  # TF: only where data is read
  task = config.mixture_or_task_name
  _check_registered("MIXTURE_OR_TASK_NAME", task)
  if config.public_task_name:
    _check_registered("train.public_task_name", config.public_task_name)
  data = data_arrays.load_task_arrays(task, "train", lengths,
                                      converter=model.converter)
  try:
    model.check_arrays(data)
  except ValueError as e:
    raise errors.UsageError(f"{task}: {e}") from None
  n = len(next(iter(data.values())))
  added = added_rows(data) if added_rows else {}
  if added:
    data = {k: np.concatenate([v, added[k]]) for k, v in data.items()}
  tokens = data_arrays.real_token_counts(data)
  units = None
  if mechanism.unit_column:
    units = _unit_ids(mechanism, model, task, lengths, n)
    if added:
      units = np.concatenate([units, _fresh_units(units, len(tokens) - n)])
    reporting.say(f"{task}: {np.unique(units).size} {mechanism.unit}s "
                  f"({mechanism.unit_column}), the unit of privacy")
  reporting.say(f"{task} train split: {len(tokens)} examples, feature "
                f"lengths {lengths}")
  trim = None
  if config.trim_padding:
    try:
      trim = padding.Trimmer(data, config.length_buckets)
    except ValueError as e:
      raise errors.UsageError(f"train.trim_padding: {e}") from None
    reporting.say("microbatches of like-length examples, token axes cut to "
                  f"{ {a: w.tolist() for a, w in trim.widths.items()} }")
  if not config.redaction_schedule:
    return _Splits(data, tokens, units, trim=trim)
  public = data_arrays.load_task_arrays(
      config.public_task_name, "train", lengths, converter=model.converter)
  public_tokens = data_arrays.real_token_counts(public)
  reporting.say(f"{config.public_task_name} train split (public): "
                f"{len(public_tokens)} examples")
  return _Splits(data, tokens, units, public, public_tokens,
                 redaction_schedule.public_sampler(
                     len(public_tokens), config.batch_size, config.seed), trim)


def _fresh_units(units: np.ndarray, m: int) -> np.ndarray:
  """m unit ids none of `units` has: each added row a unit of its own."""
  if units.dtype.kind in "iu":
    return units.max() + 1 + np.arange(m, dtype=units.dtype)
  names = [f"added-row-{i}" for i in range(m)]
  if units.dtype.kind == "S" or isinstance(units[0], bytes):  # TF's strings
    names = [x.encode() for x in names]
  fresh = np.array(names, dtype=object if units.dtype.kind == "O" else None)
  if np.isin(fresh, units).any():
    raise errors.UsageError("the training split's units already use the "
                             "names of added rows ('added-row-<i>')")
  return fresh


def _unit_ids(mechanism: mechanisms.DPSGD, model: trainable_lib.Trainable,
              task: str, lengths: dict, n: int) -> np.ndarray:
  """Each training row's privacy unit, from the task's feature the
  mechanism names (`unit_column`, e.g. `train.user_column`)."""
  from dpjax.data import arrays as data_arrays  # TF: only where data is read
  if not isinstance(model.converter, str):  # dual_encoder.PairGroups
    raise errors.UsageError(
        f"{mechanism.setting}: the dual encoder's row is a group of pairs, "
        f"not one {mechanism.unit}'s example; use the default 'example' unit")
  column = mechanism.unit_column
  try:
    units = data_arrays.load_task_column(task, "train", lengths, column)
  except ValueError as e:
    raise errors.UsageError(
        f"{mechanism.setting} needs the feature {column!r}: {e}") from None
  if len(units) != n:
    raise errors.UsageError(
        f"{task}: {len(units)} values of {column!r} for {n} training rows (a "
        f"task that packs or filters rows has no per-row {mechanism.unit})")
  return units


def step_function(plan: plan_lib.RunPlan, placed: step_lib.PlacedSteps,
                   splits: _Splits, *, mesh, rules, m: int, k: int,
                   noise_secret):
  """`step_fn(state, step) -> (state, loop.StepOutput)`: the plan's step t,
  a DP step (sample, clip per group of k microbatches of m, or with
  `train.trim_padding` per microbatch of like-length rows cut to its
  widths; one noisy release, recorded in the ledger) or a public step of
  the redaction schedule. Step t + 1's batches are sampled and placed while
  the devices run step t (`prefetch.Ahead`)."""
  # Batches [K, m, ...] split over the example axis m: each process reads
  # only the sampled rows its own devices hold.
  batch_sh = partitioning.batch_sharding(mesh, 3, batch_dim=1, rules=rules)
  mask_sh = partitioning.batch_sharding(mesh, 2, batch_dim=1, rules=rules)
  sigma = distributed.global_array(  # the ledger's σ, an argument of apply
      np.asarray(plan.noise_multiplier, np.float32),
      partitioning.replicated(mesh))

  def inputs(step: int):
    """The step's host work, done a step ahead (`prefetch.Ahead`): its
    index, its batches placed on the mesh, and its real tokens."""
    # A DP step's index is its release number (sample, dropout and noise
    # keys, ledger), a public step's its place in the public stream.
    index = int(plan.kind_index[step])
    if plan.public[step]:
      idx, mask = splits.public_sampler.microbatches(index, m)
      return index, [(distributed.global_rows(splits.public, idx, batch_sh),
                      distributed.global_array(mask, mask_sh))], int(
                          splits.public_tokens[idx[mask > 0]].sum())
    idx, mask = plan.sampler.microbatches(index, m)
    tokens = int(splits.tokens[idx[mask > 0]].sum())
    if splits.trim is None:
      calls = [(splits.train, i, mk)
               for i, mk in step_lib.microbatch_groups(idx, mask, k)]
    else:  # one call per microbatch of like-length rows, cut to its widths
      calls = [(splits.trim(i[mk > 0]), i, mk)
               for i, mk in step_lib.microbatch_groups(
                   *padding.by_length(idx, mask, splits.tokens), 1)]
    return index, [(distributed.global_rows(rows, i, batch_sh),
                    distributed.global_array(mk, mask_sh))
                   for rows, i, mk in calls], tokens

  ahead = prefetch.Ahead(inputs, stop=plan.steps)

  def step_fn(state, step: int):
    index, batches, tokens = ahead(step)
    if plan.public[step]:
      state, metrics = placed.public(state, *batches[0], index)
      return state, loop.StepOutput(False, [metrics], tokens)
    sums, metrics = placed.zero_sums(state.params), []
    for call, (batch, mask) in enumerate(batches):
      sums, call_metrics = placed.accumulate(state.params, sums, batch, mask,
                                             index, call, state.clip_norms)
      metrics.append(call_metrics)
    state = placed.apply(state, sums, noise_secret, sigma)
    plan.ledger.record_dp_steps(noise_multipliers=plan.noise_multipliers)
    return state, loop.StepOutput(True, metrics, tokens)

  return step_fn


def _existing_manager(model_dir: str, keep_checkpoints: int):
  """The checkpoint manager of the run already in `model_dir`, None if
  there is none."""
  if not os.path.isdir(os.path.join(model_dir, "checkpoints")):
    return None
  return checkpoints.manager(model_dir, max_to_keep=keep_checkpoints)


def _verified_resume(mngr, run_secret: secret_lib.RunSecret, model_dir: str
                     ) -> verify.Run:
  """The newest checkpoint that reads back, authenticated
  and verified (`verify.newest`): a run is never silently trained over
  unreadable checkpoints, nor resumed from one that fails a check."""
  step, meta, _ = verify.newest(mngr, run_secret.meta_key(), say=False)
  if len(set(distributed.all_processes(step))) > 1:
    raise errors.UsageError(
        f"the processes see different checkpoints in {model_dir}: MODEL_DIR "
        "must be on a filesystem all hosts share (e.g. GCS or NFS)")
  return verify.Run(mngr, step, meta)


def _run_secret(model_dir: str, *, resuming: bool,
                pinned_seed: int | None) -> secret_lib.RunSecret:
  """The run's secret (`secret.for_run`), process 0's on every process."""
  try:
    found = secret_lib.for_run(model_dir, resuming=resuming,
                               pinned_seed=pinned_seed)
  except secret_lib.SecretFileError as e:
    raise errors.UsageError(str(e)) from None
  packed = distributed.from_primary(found.key + bytes([found.is_pinned]))
  return secret_lib.RunSecret(packed[:-1], bool(packed[-1]))


def _initial_params(config: RunConfig, model: trainable_lib.Trainable,
                    init_run, shardings):
  """The params a new run starts from, placed by `shardings`: a dpjax run's
  (`init_run`), a pretrained checkpoint's, or `model.init_params(seed)`."""
  seed = config.seed
  if init_run:
    params = checkpoints.init_from_run(model, init_run.manager, init_run.step,
                                       shardings, seed)
    reporting.say(f"initialised from step {init_run.step} of the run "
                  f"{config.initial_checkpoint_path}")
    return params
  if config.initial_checkpoint_path:
    # The run's init key: parts the checkpoint lacks (a discriminator
    # head) start as they would without it.
    params = pretrained.load_pretrained(
        config.initial_checkpoint_path, model.config,
        shardings=shardings, rng=jax.random.PRNGKey(seed),
        base_path=config.initial_checkpoint_base_path)
    reporting.say(f"initialised from {config.initial_checkpoint_path}")
    return params
  return jax.jit(_params_initializer(model), out_shardings=shardings)(
      jax.random.PRNGKey(seed))


@functools.lru_cache(maxsize=8)
def _params_initializer(model: trainable_lib.Trainable) -> Callable:
  """`rng -> params` of `model`, one function per (memoized) model: jit's
  cache then finds the compiled initializer again for the next run of the
  same model in this process (a fresh closure would compile it again)."""
  return lambda rng: model.init_params(rng)[0]


def _write_run_files(model_dir: str, run_secret: secret_lib.RunSecret,
                     ledger: ledger_lib.PrivacyLedger,
                     config_text: Callable[[], str] | None) -> None:
  """The secret (before any release is saved), config.gin (from
  `config_text`, if any), and the ledger file rewritten from the
  checkpoint's ledger (process 0)."""
  os.makedirs(model_dir, exist_ok=True)
  if not distributed.is_primary():
    return
  if not secret_lib.exists(model_dir):
    run_secret.save(model_dir)
  if config_text is not None:
    fileio.write_atomic(os.path.join(model_dir, "config.gin"), config_text())
  if checkpoints.write_ledger(model_dir, ledger.to_json()):
    reporting.say(
        f"repaired {os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)}: "
        f"it did not match the checkpoint's ledger ({ledger.steps} DP "
        f"steps, ε spent {ledger.epsilon_spent():.4f})")


def _eval_loss_fn(eval_step, eval_data, mesh, rules, m: int,
                  eval_examples: int):
  """params -> the mean loss of the first `eval_examples` eval rows, in
  batches of m (the last one wrapped around and masked)."""
  eval_sh = partitioning.batch_sharding(mesh, 2, rules=rules)
  eval_mask_sh = partitioning.batch_sharding(mesh, 1, rules=rules)

  def evaluate(params) -> float:
    total, count = 0.0, 0.0
    num = min(eval_examples, len(next(iter(eval_data.values()))))
    for s in range(0, num, m):
      idx = np.arange(s, s + m) % num
      mask = (np.arange(s, s + m) < num).astype(np.float32)
      loss_sum, c = eval_step(
          params, distributed.global_rows(eval_data, idx, eval_sh),
          distributed.global_array(mask, eval_mask_sh))
      total, count = total + float(loss_sum), count + float(c)
    return total / max(count, 1)

  return evaluate


def _check_registered(binding: str, name: str) -> None:
  from dpjax.data import arrays as data_arrays  # TF: only where data is read
  known = data_arrays.registered_names()
  if name not in known:
    raise errors.UsageError(
        f"{binding} = {name!r} is no registered seqio task or mixture; "
        f"registered: {', '.join(known)}. A pipeline's own tasks are "
        "registered by its command (e.g. 'seqpate_private_lm' by "
        "python -m dpjax.pipelines.seqpate)")


def initial_tokenizer_files(initial_checkpoint_path: str | None,
                            base_path: str | None = None
                            ) -> dict[str, str] | None:
  """The tokenizer files a run starting from `initial_checkpoint_path` registers
  its tasks with: those the dpjax run there recorded, else the pretrained
  checkpoint's (`pretrained.tokenizer_files`; an adapter release's, else
  its base model's, `base_path` or the local one it names); None without a
  checkpoint."""
  if not initial_checkpoint_path:
    if base_path:
      raise errors.UsageError(
          "train.initial_checkpoint_base_path is the base model of an adapter "
          "release in INITIAL_CHECKPOINT_PATH, which is not set")
    return None
  path = os.path.expanduser(initial_checkpoint_path)
  run = verify.read_run(path)
  if run:
    run.manager.close()
  adapters = not run and pretrained.peft.is_adapter_dir(path)
  if base_path and not adapters:
    raise errors.UsageError(
        f"train.initial_checkpoint_base_path is the base model of an adapter "
        f"release; INITIAL_CHECKPOINT_PATH {initial_checkpoint_path} is not one")
  if run:
    return dict(run.meta.tokenizer_files)
  files = pretrained.tokenizer_files(path)
  if adapters and not files:
    return pretrained.tokenizer_files(pretrained.resolve_base(path, base_path))
  return files
