"""The settings of one training run: a typed, frozen record.

The engine takes a `RunConfig` and reads no global configuration. At the
command line it is what the gin files say: `dpjax.configurables` registers
it with gin as `train` (t5x's `train.batch_size = %BATCH_SIZE`,
`--gin.train.seed=3`), its mesh, axis rules, learning-rate schedule and
adaptive clipping under their own t5x-style names, and builds the record
(`configurables.run_config()`). Pipelines that plan several runs read a
setting as a field, not as a binding string, and derive variants with
`dataclasses.replace`.

What the settings mean for the guarantee is decided in one place,
`dpjax.training.plan.make_plan`; this module only holds them.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import optax

from dpjax import errors
from dpjax.privacy import mechanisms
from dpjax.privacy.mechanisms import adaptive_clipping as adaptive_lib
from dpjax.privacy.mechanisms import multi_loss


def as_float(value) -> float | None:
  """`value` (a number or its text, e.g. 'inf') as a float; None if it is
  neither."""
  if not (errors.is_number(value) or isinstance(value, str)):
    return None
  try:
    return float(value)
  except ValueError:
    return None


@dataclasses.dataclass(frozen=True)
class LearningRateSchedule:
  """The learning rate over a run's steps (gin `learning_rate_schedule.*`):
  `name` 'constant' | 'linear_decay' | 'cosine' | 'rsqrt' from
  `learning_rate`, after `warmup_steps` of linear warmup from 0."""
  learning_rate: float = 1e-3
  name: str = "constant"
  warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One DP training run (`python -m dpjax.train`).

  Data and model: `model_dir` (MODEL_DIR), `model_config` (a model config
  dataclass), `mixture_or_task_name`, `task_feature_lengths`.

  Steps and batches: `batch_size` (BATCH_SIZE: the expected Poisson batch,
  or the exact shuffled one), `train_steps` (TRAIN_STEPS) or `epochs`,
  `microbatch_size` (None: the padded sample in one call; 'auto': the
  largest that fits the device, `dpjax.training.sizing`, as is a model config's
  `remat = 'auto'`), `device_memory` (bytes or '80GiB' per device for
  'auto'; None: read from the backend) and `memory_headroom` (the fraction
  of it a step may use),
  `sampling_method` ('poisson' | 'shuffle'), `overflow_probability` (sizes
  the padded Poisson batch: a larger sample costs one more accumulate call,
  nothing is dropped), `trim_padding` (each step's sample ordered by length
  and each microbatch one call cut to the smallest of `length_buckets`
  widths per token axis that holds it: less padding computed, the same
  examples, losses and guarantee, `dpjax.training.padding`).

  Privacy: `privacy_unit` ('example', or 'user': Poisson sampling of users,
  each sampled user's examples clipped one by one and averaged, at most
  `max_examples_per_user` of them; the task names each example's user in
  its feature `user_column`; BATCH_SIZE, n, δ and epochs then count users),
  `target_epsilon` (a number or 'inf'), `delta` (a number, '1/n' or
  '1/(2n)'; None: 1/(2n)), `clip_norm` (a bound, or 'adaptive': it
  follows a private quantile of the gradient norms, set by
  `adaptive_clipping.*`, `dpjax.privacy.mechanisms.adaptive_clipping`),
  `clip_norms` (per-loss bounds of a model with several named losses;
  default `clip_norm` for each), `mechanism` ('dpsgd', 'bandmf': banded
  correlated noise with cyclic Poisson sampling,
  `dpjax.privacy.mechanisms.bandmf`, or any registered mechanism's name;
  `bands` None: the number of bands of least expected error at the
  target, else that number), `noise_multiplier` (None: calibrated for the
  target), `accountant` ('pld', the tighter and default, | 'rdp'),
  `prior_ledger` (an earlier run on the same data whose
  releases this run composes with), `pinned_secret_seed` (tests only: the
  secret noise and sampling become public, and the ledger says so).

  Optimisation: `optimizer` ('sgd' | 'adam' | 'adamw' | 'adafactor'),
  `learning_rate` (None: `learning_rate_schedule` over the run's steps),
  `clipping_method` ('vmap' | 'ghost' | 'auto'), `ghost_summation` (how ghost clipping forms the clipped sum: 'auto',
  'book_keeping' or 'second_pass', `dpjax.privacy.ghost`; a cost only,
  the same sum and bound), `seed` (public:
  initialisation, dropout, the redaction coins; never noise or batches),
  `initial_checkpoint_path` (a Hugging Face, t5x or dpjax run directory, or
  a PEFT LoRA adapter release), `initial_checkpoint_base_path` (an adapter
  release's base model directory, where the name it records is not a local
  one; checked against the release's fingerprint).

  Redaction schedule (Kabra & Elenberg, Findings of EMNLP 2023, arXiv
  2305.14208): `public_task_name` with `redaction_schedule`
  (`redaction_schedule.SCHEDULES`), its `redaction_schedule_eta` or
  `redaction_probability` ('constant').

  Outputs: `checkpoint_period`, `keep_checkpoints`, `log_period`,
  `eval_period` (0: no eval), `eval_examples`, `eval_split`,
  `generate_after_training` (one synthetic query per document, by the
  command line once the run is finished).

  Set at the command line by their own gin names, as t5x's: `mesh_shape`
  (`make_mesh.mesh_shape`, e.g. {'data': -1}; None: all devices on 'data'),
  `axis_rules` (`logical_axis_rules.name`,
  `dpjax.training.partitioning.RULE_SETS`), `learning_rate_schedule`
  (`learning_rate_schedule.*`) and `adaptive_clipping`
  (`adaptive_clipping.*`, read with `clip_norm = 'adaptive'`; None there:
  its defaults).
  """
  model_dir: str
  model_config: Any
  mixture_or_task_name: str
  task_feature_lengths: Mapping[str, int]
  batch_size: int
  train_steps: int | None = None
  epochs: float | None = None
  microbatch_size: int | str | None = None
  device_memory: int | str | None = None
  memory_headroom: float = 0.9
  privacy_unit: str = "example"
  user_column: str = "user_id"
  max_examples_per_user: int = 8
  target_epsilon: float | str = 3.0
  delta: float | str | None = None
  clip_norm: float | str = 0.1
  clip_norms: Mapping[str, float] | None = None
  noise_multiplier: float | None = None
  mechanism: str = "dpsgd"
  bands: int | None = None
  accountant: str = "pld"
  sampling_method: str = "poisson"
  overflow_probability: float = 0.01
  trim_padding: bool = False
  length_buckets: int = 4
  optimizer: str = "adam"
  clipping_method: str = "vmap"
  ghost_summation: str = "auto"
  learning_rate: optax.ScalarOrSchedule | None = None
  seed: int = 0
  pinned_secret_seed: int | None = None
  initial_checkpoint_path: str | None = None
  initial_checkpoint_base_path: str | None = None
  prior_ledger: str | None = None
  public_task_name: str | None = None
  redaction_schedule: str | None = None
  redaction_schedule_eta: float = 15.0
  redaction_probability: float | None = None
  checkpoint_period: int = 1000
  keep_checkpoints: int = 3
  log_period: int = 10
  eval_period: int = 0
  eval_examples: int = 2048
  eval_split: str = "validation"
  generate_after_training: bool = False
  mesh_shape: Mapping[str, int] | None = None
  axis_rules: str = "data_parallel"
  learning_rate_schedule: LearningRateSchedule = LearningRateSchedule()
  adaptive_clipping: adaptive_lib.AdaptiveClipping | None = None


def check(config: RunConfig) -> float:
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
  eps = as_float(target_epsilon)
  if eps is None or not eps > 0:  # NaN too
    raise errors.UsageError(
        "TARGET_EPSILON (train.target_epsilon) must be a positive number or "
        f"'inf', got {target_epsilon!r}")
  if delta is not None and delta not in ("1/n", "1/(2n)"):
    value = as_float(delta)
    if value is None or not 0 < value < 1:
      raise errors.UsageError(
          "DELTA (train.delta) must be a number strictly between 0 and 1, "
          f"'1/n' or '1/(2n)' (None: 1/(2n)), got {delta!r}")
  if not errors.is_int(batch_size) or batch_size < 1:
    raise errors.UsageError("BATCH_SIZE (train.batch_size) must be a "
                             f"positive integer, got {batch_size!r}")
  if microbatch_size not in (None, "auto") and (
      not errors.is_int(microbatch_size) or microbatch_size < 1):
    raise errors.UsageError(
        "MICROBATCH_SIZE (train.microbatch_size) must be a positive integer, "
        f"'auto' or None, got {microbatch_size!r}")
  buckets = config.length_buckets
  if not errors.is_int(buckets) or buckets < 1:
    raise errors.UsageError("train.length_buckets must be a positive "
                             f"integer, got {buckets!r}")
  headroom = config.memory_headroom
  if not errors.is_number(headroom) or not 0 < headroom <= 1:
    raise errors.UsageError("train.memory_headroom must be in (0, 1], got "
                             f"{headroom!r}")
  if train_steps is not None and (not errors.is_int(train_steps)
                                  or train_steps < 1):
    raise errors.UsageError("TRAIN_STEPS (train.train_steps) must be a "
                             f"positive integer or None, got {train_steps!r}")
  if epochs is not None and (not errors.is_number(epochs)
                             or not 0 < epochs < math.inf):
    raise errors.UsageError("EPOCHS (train.epochs) must be a positive "
                             f"number or None, got {epochs!r}")
  multi_loss.check_clipping(config.clipping_method, config.ghost_summation)
  # The mechanism's own settings, and its first bound.
  clip_norm = mechanisms.from_config(config).initial_clip_norm(clip_norm)
  for name, c in [("CLIP_NORM (train.clip_norm)", clip_norm),
                  *((f"train.clip_norms[{k!r}]", v)
                    for k, v in dict(clip_norms or {}).items())]:
    if not errors.is_number(c) or not 0 < c < math.inf:
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
