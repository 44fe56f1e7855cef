"""DP training of a T5 or GPT-2 model on a seqio task (`python -m dpjax.train`).

  python -m dpjax.train --gin_file=gin/msmarco_t5_xl_eps3.gin \\
      --gin.MODEL_DIR=/runs/xl_eps3 [--gin.NAME=VALUE ...]

The run is planned before anything is written: the data is loaded and counted,
the sampler fixed, the noise multiplier calibrated with dp-accounting for the
target (ε, δ) over all planned steps, and a run that would exceed its budget
refuses to start. Then one jit-compiled DP step per logical batch (see
dpjax.train_step), periodic eval loss, TensorBoard summaries, a console
progress line and orbax checkpoints that carry the privacy ledger and resume
exactly: batches and noise are pure functions of (secret, step), where the
secret is the run's 256 bits of OS entropy (`privacy.secret`, in
MODEL_DIR/secret_key.json, never published); `train.seed` keys only what the
guarantee does not rest on (initialisation, dropout, the redaction coins).

With `train.public_task_name` and `train.redaction_schedule` the run follows
a redaction schedule (dpjax.privacy.redaction_schedule, shared/papers/004):
each step is, by a public coin flipped before training, either a DP step on
the original task or a non-private step on the public (redacted) task, both
updating one optimizer state. Only the DP steps are releases: σ is calibrated
for exactly their number, and only they enter the ledger. A finished dpjax run
directory is also a valid INITIAL_CHECKPOINT_PATH, e.g. JFT: a DP run started
from a run trained on redacted data. Its model must be this run's, or a field
of this run's config (the GPT-2 that a GPT-2 + discriminator head extends,
shared/papers/002's post-hoc head); the top-level param subtrees its
checkpoint lacks (the head) are freshly initialised, and said so.

A model with several named per-example losses (`Trainable.example_losses`:
GPT-2 + discriminator head, shared/papers/002) makes one release per loss
each step: every per-example gradient of loss k (w.r.t. the trainable
params; frozen layers get none) is clipped to its own C_k
(`train.clip_norms`, default `clip_norm` for every loss), each clipped sum
gets its own Gaussian noise σ C_k, and the noisy sums are added before the
one base optimizer. One σ serves all k releases, calibrated so that T steps
of k Gaussians on the same Poisson sample, `PoissonGaussian(q, (σ,)*k, T)`,
meet the target; the ledger records exactly that event. (Separate clipping,
not one joint clip of the summed gradient: the paper's Algorithm 1.)

The same command runs on every host of a multi-host job (dpjax.distributed):
each process reads only the sampled rows its devices hold, process 0 alone
writes the console, summaries and ledger file, and a SIGTERM reaching any host
checkpoints all of them at one step boundary.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Mapping

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import (checkpoints, distributed, fileio, gin_cli, partitioning,
                   plan as plan_lib, reporting, train_step)
from dpjax.models import trainable as trainable_lib
from dpjax.privacy import accounting, clipping, ledger as ledger_lib
from dpjax.privacy import optimizers as dp_optimizers
from dpjax.privacy import redaction_schedule as redaction_lib, sampling
from dpjax.privacy import secret as secret_lib

# Base optimizers: a DP step runs `dp_optimizers.dp_optimizer(base)`, a public
# step `base` alone on the same state (`dp_optimizers.public_update`).
OPTIMIZERS = {"sgd": optax.sgd, "adam": optax.adam, "adamw": optax.adamw,
              "adafactor": optax.adafactor}


@gin.configurable
def learning_rate_schedule(learning_rate: float = 1e-3, *,
                           name: str = "constant", warmup_steps: int = 0,
                           total_steps: int | None = None) -> optax.Schedule:
  """'constant' | 'linear_decay' | 'cosine' | 'rsqrt', after linear warmup."""
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
    raise gin_cli.UsageError(f"unknown learning-rate schedule {name!r}")
  if warmup_steps <= 0:
    return after
  return optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, warmup_steps), after],
      [warmup_steps])


def _microbatch_groups(idx, mask, k):
  """Splits [K', m] index/mask arrays into groups of exactly k microbatches."""
  groups = []
  for start in range(0, len(idx), k):
    i, m = idx[start:start + k], mask[start:start + k]
    if len(i) < k:  # overflow remainder: pad with masked rows
      pad = k - len(i)
      i = np.concatenate([i, np.zeros((pad, i.shape[1]), i.dtype)])
      m = np.concatenate([m, np.zeros((pad, m.shape[1]), m.dtype)])
    groups.append((i, m))
  return groups


def _existing_run(model_dir: str, keep_checkpoints: int):
  """(manager, (step, meta) of the newest checkpoint whose meta reads back)
  of the run already in `model_dir`: (None, None) if there is none, (manager,
  None) if it saved nothing yet. Checkpoints none of which reads back are
  refused (`checkpoints.latest_meta`): never silently trained over."""
  if not os.path.isdir(os.path.join(model_dir, "checkpoints")):
    return None, None
  mngr = checkpoints.manager(model_dir, max_to_keep=keep_checkpoints)
  resume = checkpoints.latest_meta(mngr)
  if len(set(distributed.all_processes(resume[0] if resume else -1))) > 1:
    raise gin_cli.UsageError(
        f"the processes see different checkpoints in {model_dir}: MODEL_DIR "
        "must be on a filesystem all hosts share (e.g. GCS or NFS)")
  return mngr, resume


def _run_secret(model_dir: str, *, resuming: bool,
                pinned_seed: int | None) -> secret_lib.RunSecret:
  """The run's secret (`secret.for_run`), process 0's on every process."""
  try:
    found = secret_lib.for_run(model_dir, resuming=resuming,
                               pinned_seed=pinned_seed)
  except secret_lib.SecretFileError as e:
    raise gin_cli.UsageError(str(e)) from None
  packed = distributed.from_primary(found.key + bytes([found.is_pinned]))
  return secret_lib.RunSecret(packed[:-1], bool(packed[-1]))


def _base_optimizer(name: str, learning_rate: optax.ScalarOrSchedule
                    ) -> optax.GradientTransformation:
  if name not in OPTIMIZERS:
    raise gin_cli.UsageError(f"unknown optimizer {name!r}; choose from "
                             f"{sorted(OPTIMIZERS)}")
  return OPTIMIZERS[name](learning_rate)


def _trainable(model: trainable_lib.Trainable):
  """The model's trainable-leaf mask (of its abstract params), or None."""
  if model.trainable_mask is None:
    return None
  return model.trainable_mask(model.abstract_params()[0])


def _model_base(model: trainable_lib.Trainable, optimizer: str,
                learning_rate: optax.ScalarOrSchedule
                ) -> optax.GradientTransformation:
  base = _base_optimizer(optimizer, learning_rate)
  mask = _trainable(model)
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
      raise gin_cli.UsageError(
          f"train.clip_norms {dict(clip_norms)} is for a model with several "
          "losses; this one has one: set train.clip_norm")
    return None
  extra = set(clip_norms or {}) - set(model.loss_names)
  if extra:
    raise gin_cli.UsageError(f"train.clip_norms names {sorted(extra)}; the "
                             f"model's losses are {list(model.loss_names)}")
  return {k: float((clip_norms or {}).get(k, clip_norm))
          for k in model.loss_names}


def build_dp_step(model: trainable_lib.Trainable, *, clip_norm: float,
                  optimizer: str, learning_rate: optax.ScalarOrSchedule,
                  noise_multiplier: float, normalizer: float, seed: int,
                  clipping_method: str = "vmap",
                  clip_norms: Mapping[str, float] | None = None):
  """(DP optimizer, accumulate, apply) for a model: the un-jitted DP step.

  `clipping_method`: 'vmap' (per-example gradients), 'ghost' (ghost norms:
  no per-example weight gradients) or 'auto' (ghost when the
  model has intercepted layers); all give the same clipped sum and bound.
  A multi-loss model (`loss_clip_norms`) clips by vmap only ('auto' is vmap):
  one clipped sum per loss, noised separately with the one σ. With
  rematerialised layers (a config's `remat`) ghost clipping takes its sum
  from a second backward pass instead of book-keeping (`ghost.py`).
  `seed` keys dropout only (public); `apply(state, grads, noise_secret)`
  takes the run's secret noise key (`RunSecret.noise_key()`).
  """
  if clipping_method not in ("vmap", "ghost", "auto"):
    raise gin_cli.UsageError(f"train.clipping_method must be 'vmap', 'ghost' or "
                             f"'auto', got {clipping_method!r}")
  base = _model_base(model, optimizer, learning_rate)
  bounds = loss_clip_norms(model, clip_norm, clip_norms)
  if bounds is None:
    clipped = clipping.make_clipped_grad(model.example_loss, clip_norm=clip_norm,
                                         method=clipping_method)
    tx = dp_optimizers.dp_optimizer(base, noise_multiplier=noise_multiplier,
                                    sensitivity=clipped.sensitivity,
                                    normalizer=normalizer)
  else:
    if clipping_method == "ghost":
      raise gin_cli.UsageError(
          "train.clipping_method = 'ghost' does not support a model with "
          "several losses or frozen layers; use 'vmap'")
    clipped = clipping.multi_loss_clipped_grad(
        model.example_losses, clip_norms=bounds, trainable=_trainable(model))
    tx = dp_optimizers.dp_optimizer_releases(
        base, noise_multipliers={k: noise_multiplier for k in bounds},
        sensitivities=clipped.sensitivities, normalizer=normalizer,
        trainable=_trainable(model))
  accumulate = train_step.make_accumulate(clipped, seed=seed,
                                          dropout=model.example_rng)
  return tx, accumulate, train_step.make_apply(tx)


def build_public_step(model: trainable_lib.Trainable, *, optimizer: str,
                      learning_rate: optax.ScalarOrSchedule, seed: int):
  """The un-jitted non-private step on a public batch, on the state of
  `build_dp_step`'s DP optimizer (same `optimizer` and `learning_rate`)."""
  return train_step.make_public_step(
      model.example_loss,
      dp_optimizers.public_update(_model_base(model, optimizer, learning_rate)),
      seed=seed, dropout=model.example_rng)


def _check_registered(binding: str, name: str) -> None:
  from dpjax.data import arrays as data_arrays  # TF: only where data is read
  known = data_arrays.registered_names()
  if name not in known:
    raise gin_cli.UsageError(
        f"{binding} = {name!r} is no registered seqio task or mixture; "
        f"registered: {', '.join(known)}. A pipeline's own tasks are "
        "registered by its command (e.g. 'seqpate_private_lm' by "
        "python -m dpjax.seqpate)")


def initial_tokenizer_files(initial_checkpoint_path: str | None
                            ) -> dict[str, str] | None:
  """The tokenizer files a run starting from `initial_checkpoint_path` registers
  its tasks with: those the dpjax run there recorded, else the pretrained
  checkpoint's (`pretrained.tokenizer_files`); None without a checkpoint."""
  if not initial_checkpoint_path:
    return None
  run = checkpoints.read_run(os.path.expanduser(initial_checkpoint_path))
  if run:
    run[0].close()
    return run[2].get("tokenizer_files")
  from dpjax import pretrained
  return pretrained.tokenizer_files(initial_checkpoint_path)


@gin.configurable
def train(*, model_dir: str = gin.REQUIRED,
          model_config=gin.REQUIRED,
          mixture_or_task_name: str = gin.REQUIRED,
          task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
          batch_size: int = gin.REQUIRED,
          train_steps: int | None = None,
          epochs: float | None = None,
          microbatch_size: int | None = None,
          target_epsilon: float | str = 3.0,
          delta: float | str | None = None,
          clip_norm: float = 0.1,
          clip_norms: Mapping[str, float] | None = None,
          noise_multiplier: float | None = None,
          accountant: str = "rdp",
          sampling_method: str = "poisson",
          overflow_probability: float = 0.01,
          optimizer: str = "adam",
          clipping_method: str = "vmap",
          learning_rate: optax.ScalarOrSchedule | None = None,
          seed: int = 0,
          pinned_secret_seed: int | None = None,
          initial_checkpoint_path: str | None = None,
          prior_ledger: str | None = None,
          public_task_name: str | None = None,
          redaction_schedule: str | None = None,
          redaction_schedule_eta: float = 15.0,
          redaction_probability: float | None = None,
          checkpoint_period: int = 1000,
          keep_checkpoints: int = 3,
          log_period: int = 10,
          eval_period: int = 0,
          eval_examples: int = 2048,
          eval_split: str = "validation",
          generate_after_training: bool = False) -> dict:
  """Runs (or resumes) one DP training job; returns a summary dict.

  `prior_ledger`: the privacy ledger file of an earlier run on the same
  training set (e.g. stage 1 of the two-stage semantic-parse pipeline); this
  run's ε composes with it (see `plan_privacy`).

  Redaction schedule (shared/papers/004): `public_task_name` is the public
  (redacted) task and `redaction_schedule` one of
  `redaction_schedule.SCHEDULES` ('exp_concave' in the paper, with
  `redaction_schedule_eta` = 15; 'constant' takes `redaction_probability`).
  Each step t of the T steps (TRAIN_STEPS, or EPOCHS of the original data) is
  with probability p(t) a non-private step on a shuffled public batch of
  BATCH_SIZE rows, else a DP step; σ is calibrated for the planned DP steps.

  `clipping_method`: 'vmap', 'ghost' or 'auto' (`build_dp_step`); the mesh
  and its rule set come from `partitioning.make_mesh` and
  `partitioning.logical_axis_rules` (e.g. `logical_axis_rules.name = 'fsdp'`).

  `delta`: a number, '1/n' or '1/(2n)' (None: 1/(2n)). `clip_norms`: per-loss
  bounds of a multi-loss model (see the module docstring). `eval_split`: the
  task split of the eval loss.

  `overflow_probability` sizes the padded Poisson batch: a sample larger than
  the padded shape costs one more accumulate call (nothing is dropped, the
  guarantee is unchanged), so a few percent of such steps is cheaper than
  padding every step for the far tail.
  """
  distributed.initialize()  # before any other JAX use; single process: no-op
  import tasks  # the data layer (TensorFlow) is only imported by the driver
  from dpjax.data import arrays as data_arrays
  wall_start = time.perf_counter()
  model_dir = os.path.abspath(os.path.expanduser(model_dir))
  target_epsilon = plan_lib.check_run_inputs(
      model_dir=model_dir, target_epsilon=target_epsilon, delta=delta,
      batch_size=batch_size, train_steps=train_steps, epochs=epochs,
      clip_norm=clip_norm, clip_norms=clip_norms,
      microbatch_size=microbatch_size)
  if (public_task_name is None) != (redaction_schedule is None):
    raise gin_cli.UsageError(
        "train.public_task_name and train.redaction_schedule go together: "
        f"got {public_task_name!r} and {redaction_schedule!r}")

  # --- Data: validated before anything is written. -------------------------
  init_run = (checkpoints.read_run(os.path.expanduser(initial_checkpoint_path))
              if initial_checkpoint_path else None)
  tokenizer = initial_tokenizer_files(initial_checkpoint_path)
  tasks.register_tasks(tokenizer_files=tokenizer)
  lengths = dict(task_feature_lengths)
  try:
    model = trainable_lib.trainable(model_config, lengths)
  except (TypeError, KeyError) as e:
    raise gin_cli.UsageError(f"train.model_config / TASK_FEATURE_LENGTHS: {e}")
  if init_run:  # a dpjax run directory (e.g. JFT's stage 1): the same model,
    # or the one this model extends (`init_from_run`)
    saved = init_run[2]
    saved_model = _architecture({"class": saved.get("model_class") or "T5Config",
                                 **saved["model_config"]})
    if saved_model not in _model_and_parts(model_config):
      checkpoints.check_compatible(
          saved_model, _architecture(_model_json(model_config)), "model",
          source="the run in INITIAL_CHECKPOINT_PATH",
          fix="Configure the model it was trained with (or one that extends "
              "it, e.g. GPT2DiscConfig.lm = that model).")
  _check_registered("MIXTURE_OR_TASK_NAME", mixture_or_task_name)
  if public_task_name:
    _check_registered("train.public_task_name", public_task_name)
  data = data_arrays.load_task_arrays(mixture_or_task_name, "train", lengths,
                                      converter=model.converter)
  try:
    model.check_arrays(data)
  except ValueError as e:
    raise gin_cli.UsageError(f"{mixture_or_task_name}: {e}") from None
  token_counts = data_arrays.real_token_counts(data)
  n = len(token_counts)
  plan_lib.check_batch_size(batch_size, n, delta)
  reporting.say(f"{mixture_or_task_name} train split: {n} examples, "
                f"feature lengths {lengths}")
  steps = plan_lib.steps_for(train_steps, epochs, n, batch_size)
  mngr, resume = _existing_run(model_dir, keep_checkpoints)
  run_secret = _run_secret(model_dir, resuming=resume is not None,
                           pinned_seed=pinned_secret_seed)
  sampler = plan_lib.make_sampler(sampling_method, n, batch_size,
                                  run_secret.sampling_seed(),
                                  overflow_probability)
  delta = plan_lib.resolve_delta(delta, n)
  bounds = loss_clip_norms(model, float(clip_norm), clip_norms)
  public, redaction = np.zeros(steps, bool), None  # no schedule: all DP
  if redaction_schedule:
    public_data = data_arrays.load_task_arrays(
        public_task_name, "train", lengths, converter=model.converter)
    public_tokens = data_arrays.real_token_counts(public_data)
    public_sampler = plan_lib.public_sampler(len(public_tokens), batch_size,
                                             seed)
    reporting.say(f"{public_task_name} train split (public): "
                  f"{len(public_tokens)} examples")
    public, redaction = plan_lib.plan_redaction(
        redaction_schedule, total_steps=steps, eta=redaction_schedule_eta,
        probability=redaction_probability, seed=seed,
        public_task=public_task_name, public_dataset_size=len(public_tokens))
  kind_index = redaction_lib.kind_indices(public)
  dp_before = lambda t: int(np.count_nonzero(~public[:t]))  # DP steps < t

  # --- Privacy plan: resume the ledger or calibrate σ; refuse to overspend. -
  prior = plan_lib.read_prior_ledger(prior_ledger)

  def plan_from(saved_meta):  # the ledger records where its keys came from
    ledger, plan = plan_lib.plan_privacy(
        sampler, saved_meta=saved_meta, steps=steps,
        batch_size=batch_size, sampling_method=sampling_method,
        clip_norm=float(clip_norm), delta=delta, target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier, accountant=accountant, seed=seed,
        prior=prior, redaction=redaction, clip_norms=bounds)
    ledger.secret = run_secret.source
    return ledger, plan

  ledger, plan = plan_from(resume[1] if resume else None)
  if resume:
    checkpoints.check_compatible(_architecture(resume[1]["model_config"]),
                                 _architecture(_config_json(model_config)), "model")
  sigma = ledger.noise_multiplier
  multipliers = plan_lib.plan_multipliers(plan)
  planned_eps = accounting.epsilon(
      ledger.all_events + ledger.planned_events(plan.dp_steps, multipliers),
      delta, accountant)
  reporting.say(
      (f"{steps} DP steps" if redaction is None else
       f"{steps} steps ({redaction_schedule} redaction schedule): "
       f"{plan.dp_steps} DP steps and {steps - plan.dp_steps} public steps on "
       f"{public_task_name}") + f", {sampler.describe()['method']} sampling "
      f"(q={batch_size / n:.4g}), σ={sigma:.4f}, "
      f"C={bounds if bounds else clip_norm}, δ={delta:.3g}"
      f", planned ε={planned_eps:.4f} (target {target_epsilon})")
  if run_secret.is_pinned:
    reporting.say(
        "WARNING: the noise and batches are pinned (train.pinned_secret_seed):"
        " whoever knows the seed can regenerate them, and this run's (ε, δ) "
        "does not hold against them; the ledger records the secret as pinned")

  # --- Model, mesh, optimizer, state. ---------------------------------------
  mesh = partitioning.make_mesh()
  rules = partitioning.logical_axis_rules()
  data_devices = partitioning.data_parallel_size(mesh, rules)
  m = microbatch_size or sampler.max_batch_size
  m = -(-m // data_devices) * data_devices
  k = -(-sampler.max_batch_size // m)
  abstract, axes = model.abstract_params()
  schedule = learning_rate if learning_rate is not None else \
      learning_rate_schedule(total_steps=steps)
  normalizer = (sampler.sampling_rate * n
                if isinstance(sampler, sampling.PoissonSampler) else batch_size)
  tx, accumulate_fn, apply_fn = build_dp_step(
      model, clip_norm=float(clip_norm), optimizer=optimizer,
      learning_rate=schedule, noise_multiplier=float(sigma),
      normalizer=normalizer, seed=seed, clipping_method=clipping_method,
      clip_norms=bounds)
  # Params by their logical axes (replicated, FSDP or tensor-parallel per the
  # rule set); optimizer moments like their params; counters replicated.
  state_sh = partitioning.state_shardings(mesh, tx, abstract, axes, rules)
  param_sh = state_sh.params
  target = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(lambda p: train_step.init_state(p, tx), abstract),
      state_sh)
  start_step = 0
  if resume:  # restored straight into place (any saved mesh: re-sharded)
    start_step, state, saved = checkpoints.restore_newest(mngr, target,
                                                          model_dir)
    if start_step != resume[0]:  # newer ones unreadable: this one's ledger
      ledger, plan = plan_from(saved)
    plan_lib.check_release_counts(
        ledger, checkpoint_step=start_step, dp_steps=dp_before(start_step),
        noise_count=int(dp_optimizers.noise_count(state.opt_state)))
    reporting.say(f"resumed {model_dir} at step {start_step}, "
                  f"ε spent {ledger.epsilon_spent():.4f}")
  else:  # built in place on the mesh, the same on every process
    if init_run:
      params = init_from_run(model, init_run[0], init_run[1], param_sh, seed)
      reporting.say(f"initialised from step {init_run[1]} of the run "
                    f"{initial_checkpoint_path}")
    elif initial_checkpoint_path:
      from dpjax import pretrained
      # The run's init key: parts the checkpoint lacks (a discriminator
      # head) start as they would without it.
      params = pretrained.load_pretrained(initial_checkpoint_path, model_config,
                                          shardings=param_sh,
                                          rng=jax.random.PRNGKey(seed))
      reporting.say(f"initialised from {initial_checkpoint_path}")
    else:
      params = jax.jit(lambda: model.init_params(jax.random.PRNGKey(seed))[0],
                       out_shardings=param_sh)()
    state = jax.jit(lambda p: train_step.init_state(p, tx),
                    out_shardings=jax.tree.map(lambda x: x.sharding, target)
                    )(params)
    mngr = mngr or checkpoints.manager(model_dir, max_to_keep=keep_checkpoints)
  if init_run:  # read; orbax's threads need not live through the run
    init_run[0].close()
  os.makedirs(model_dir, exist_ok=True)
  if distributed.is_primary():
    if not secret_lib.exists(model_dir):  # before any release is saved
      run_secret.save(model_dir)
    fileio.write_atomic(os.path.join(model_dir, "config.gin"),
                        gin.config_str())
    if checkpoints.write_ledger(model_dir, ledger.to_json()):
      reporting.say(
          f"repaired {os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)}: "
          f"it did not match the checkpoint's ledger ({ledger.steps} DP "
          f"steps, ε spent {ledger.epsilon_spent():.4f})")

  # A multi-loss model accumulates one sum per loss.
  grads_sh = {k: param_sh for k in bounds} if bounds else param_sh
  accumulate = jax.jit(accumulate_fn, donate_argnums=(1,), out_shardings=(
      grads_sh, partitioning.replicated(mesh)))
  apply = jax.jit(apply_fn, donate_argnums=(0,), out_shardings=state_sh)
  noise_secret = distributed.global_array(run_secret.noise_key(),
                                          partitioning.replicated(mesh))
  public_step = jax.jit(build_public_step(
      model, optimizer=optimizer, learning_rate=schedule, seed=seed),
      donate_argnums=(0,),
      out_shardings=(state_sh, partitioning.replicated(mesh)))
  eval_step = jax.jit(train_step.make_eval_step(model.batch_loss))
  zero_grads = jax.jit(
      lambda p: ({k: train_step.zeros_like_f32(p) for k in bounds} if bounds
                 else train_step.zeros_like_f32(p)), out_shardings=grads_sh)
  # Batches [K, m, ...] split over the example axis m: each process reads
  # only the sampled rows its own devices hold.
  batch_sh = partitioning.batch_sharding(mesh, 3, batch_dim=1, rules=rules)
  mask_sh = partitioning.batch_sharding(mesh, 2, batch_dim=1, rules=rules)
  eval_data = (data_arrays.load_task_arrays(
      mixture_or_task_name, eval_split, lengths, converter=model.converter)
      if eval_period else None)

  def meta(step):
    return {"ledger": ledger.to_json(), "plan": plan.guarantee(),
            "model_class": type(model_config).__name__,
            "model_config": _config_json(model_config),
            "data_position": {
                "step": step, "seed": seed,
                "dp_steps": dp_before(step),
                "public_steps": step - dp_before(step)},
            "sampler": sampler.describe(),
            "mixture_or_task_name": mixture_or_task_name,
            "task_feature_lengths": lengths,
            "initial_checkpoint_path": initial_checkpoint_path,
            "tokenizer_files": tokenizer or {}}

  eval_sh = partitioning.batch_sharding(mesh, 2, rules=rules)
  eval_mask_sh = partitioning.batch_sharding(mesh, 1, rules=rules)

  def run_eval(params) -> float:
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

  summaries = reporting.Summaries(model_dir)
  progress = reporting.Progress(steps, start_step)
  window: list[dict] = []  # accumulate metrics of the DP steps
  public_window: list[dict] = []
  window_steps, window_tokens, window_start = 0, 0, time.perf_counter()
  last = {}
  done = start_step
  with distributed.preemption_watch() as preempted:
    for step in range(start_step, steps):
      # A DP step's index is its release number (sample, dropout and noise
      # keys, ledger), a public step's its place in the public stream.
      index = int(kind_index[step])
      if public[step]:
        idx, mask = public_sampler.microbatches(index, m)
        window_tokens += int(public_tokens[idx[mask > 0]].sum())
        state, metrics = public_step(
            state, distributed.global_rows(public_data, idx, batch_sh),
            distributed.global_array(mask, mask_sh), index)
        public_window.append(metrics)
      else:
        idx, mask = sampler.microbatches(index, m)
        window_tokens += int(token_counts[idx[mask > 0]].sum())
        grads = zero_grads(state.params)
        for call, (i, mk) in enumerate(_microbatch_groups(idx, mask, k)):
          batch = distributed.global_rows(data, i, batch_sh)
          grads, metrics = accumulate(state.params, grads, batch,
                                      distributed.global_array(mk, mask_sh),
                                      index, call)
          window.append(metrics)
        state = apply(state, grads, noise_secret)
        ledger.record_dp_steps(noise_multipliers=multipliers)
        window_steps += 1
      done = step + 1
      if done % log_period == 0 or done == steps:
        last = _window_metrics(
            jax.device_get(window), jax.device_get(public_window),
            window_steps, window_tokens, time.perf_counter() - window_start)
        last["epsilon"] = ledger.epsilon_spent()
        last["learning_rate"] = float(
            schedule(done) if callable(schedule) else schedule)
        last["dp_steps"], last["public_steps"] = ledger.steps, done - ledger.steps
        summaries.scalars("train", done, last)
        progress.report(done, loss=last.get("loss", math.nan),
                        eps_spent=last["epsilon"], eps_target=target_epsilon,
                        tokens_per_s=last["tokens_per_second"],
                        clipped=last.get("clipped_fraction", math.nan),
                        mixed=(last["dp_steps"], last["public_steps"],
                               last.get("public_loss", math.nan))
                        if redaction else None)
        window, public_window, window_steps, window_tokens = [], [], 0, 0
        window_start = time.perf_counter()
      if eval_period and (done % eval_period == 0 or done == steps):
        last["eval_loss"] = run_eval(state.params)
        summaries.scalars("eval", done, {"loss": last["eval_loss"]})
        reporting.say(f"step {done} eval loss {last['eval_loss']:.4f}")
      stop = preempted()  # the same answer on every process
      if done % checkpoint_period == 0 or done == steps or stop:
        checkpoints.save(mngr, done, state, meta(done), model_dir)
      if stop:  # said by every process, in every host's log
        print(f"dpjax: SIGTERM: checkpointed step {done}; rerun the same "
              "command to resume", flush=True)
        break
  summaries.close()
  mngr.close()  # orbax's threads and event loops; a long job trains many runs
  eps = ledger.epsilon_spent()
  result = {"model_dir": model_dir, "steps": steps, "steps_done": done,
            "epsilon_spent": eps, "target_epsilon": target_epsilon,
            "delta": delta, "noise_multiplier": sigma,
            "wall_seconds": time.perf_counter() - wall_start, **last,
            "dp_steps": ledger.steps, "public_steps": done - ledger.steps}
  reporting.say(
      f"{'trained' if done == steps else 'stopped'} {model_dir} at "
      f"step {done}/{steps} ({ledger.steps} DP steps): ε spent {eps:.4f} of "
      f"{target_epsilon} (δ={delta:.3g}); checkpoints in "
      f"{os.path.join(model_dir, 'checkpoints')}, privacy ledger in "
      f"{os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)}")
  if generate_after_training and done == steps:
    if jax.process_count() == 1:
      from dpjax import inference
      result["generation"] = inference.generate_synthetic(model_dir=model_dir)
    else:
      reporting.say("generation runs on one host: python -m dpjax.infer "
                    f"--model_dir={model_dir}")
  if distributed.is_primary():
    fileio.write_atomic(os.path.join(model_dir, "train_summary.json"),
                        json.dumps(result, indent=2, default=str))
  return result


def _config_json(model_config) -> dict:
  """The config as a checkpoint's JSON meta reads back (tuples as lists)."""
  return json.loads(json.dumps(model_config.to_json()))


# Model settings that change how a step computes, not the params: a run may
# resume, or start from another run, with a different value.
_COMPUTE_ONLY = ("remat",)


def _architecture(config_json: dict) -> dict:
  """A model config's JSON without `_COMPUTE_ONLY` keys, nested configs too."""
  return {k: _architecture(v) if isinstance(v, dict) else v
          for k, v in config_json.items() if k not in _COMPUTE_ONLY}


def _model_json(model_config) -> dict:
  return {"class": type(model_config).__name__, **_config_json(model_config)}


def _model_and_parts(model_config) -> list[dict]:
  """`_model_json` of the config and of each model config among its fields
  (e.g. a GPT2DiscConfig's `lm`): the models whose runs can initialise it."""
  parts = [getattr(model_config, f.name)
           for f in dataclasses.fields(model_config)]
  return [_architecture(_model_json(c)) for c in (model_config, *parts)
          if dataclasses.is_dataclass(c) and hasattr(c, "to_json")]


def init_from_run(model: trainable_lib.Trainable, mngr, step: int,
                  shardings, seed: int):
  """The params of checkpoint `step` of a run, placed by `shardings` (a
  params-shaped tree): every top-level subtree the checkpoint holds is read
  back; those it lacks (the head of a model extending the run's) are
  `model.init_params(PRNGKey(seed))`'s, computed alone (jit drops the rest
  of the init) and named on the console."""
  saved = mngr.item_metadata(step)["state"]["params"]
  extra = sorted(set(saved) - set(shardings))
  if extra:
    raise checkpoints.CheckpointMismatchError(
        f"the run in INITIAL_CHECKPOINT_PATH has params {extra} this model "
        "does not have")
  params = checkpoints.restore_params(
      mngr, step, {k: shardings[k] for k in saved})
  missing = [k for k in shardings if k not in saved]
  if missing:
    params.update(jax.jit(
        lambda: {k: model.init_params(jax.random.PRNGKey(seed))[0][k]
                 for k in missing},
        out_shardings={k: shardings[k] for k in missing})())
    reporting.say(f"{missing}: not in the run's checkpoint, freshly "
                  f"initialised (seed {seed})")
  return params


def _window_metrics(dp: list[dict], public: list[dict], dp_steps: int,
                    num_tokens: int, seconds: float) -> dict:
  """Aggregates the metrics of the steps since the last report: `accumulate`'s
  of the DP steps, and the loss of the public steps as `public_loss`."""
  metrics = {"tokens_per_second": num_tokens / max(seconds, 1e-9)}
  # One loss: plain names; several: `name/...` per loss, and `loss` their sum.
  prefixes = sorted(k[:-len("loss_sum")] for k in (dp[0] if dp else {})
                    if k.endswith("loss_sum"))
  for p in prefixes:
    real = sum(h[p + "num_examples"] for h in dp)
    metrics.update({
        p + "loss": sum(h[p + "loss_sum"] for h in dp) / max(real, 1),
        p + "clipped_fraction":
            sum(h[p + "num_clipped"] for h in dp) / max(real, 1),
        p + "nonfinite_examples": float(sum(h[p + "num_nonfinite"] for h in dp)),
        p + "examples_per_step": real / max(dp_steps, 1),
        **{q: float(np.mean([h[q] for h in dp]))
           for q in dp[0] if q.startswith(p + "grad_norm_p")},
    })
  if prefixes and "" not in prefixes:
    metrics["loss"] = sum(metrics[p + "loss"] for p in prefixes)
    metrics["clipped_fraction"] = max(metrics[p + "clipped_fraction"]
                                      for p in prefixes)
  if public:
    metrics["public_loss"] = (sum(h["loss_sum"] for h in public)
                              / max(sum(h["num_examples"] for h in public), 1))
  return metrics
