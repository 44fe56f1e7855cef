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
from typing import Any, Mapping

import numpy as np
import optax

from dpjax.privacy import adaptive_clipping as adaptive_lib


def is_int(value) -> bool:
  """An integer setting (bool is not one)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
  """A numeric setting (bool is not one)."""
  return isinstance(value, (int, float, np.integer, np.floating)) and \
      not isinstance(value, bool)


def as_float(value) -> float | None:
  """`value` (a number or its text, e.g. 'inf') as a float; None if it is
  neither."""
  if not (is_number(value) or isinstance(value, str)):
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
  `target_epsilon` (a number or 'inf'), `delta` (a number, '1/n'
  or '1/(2n)'; None: 1/(2n)), `clip_norm` (a bound, or 'adaptive': it
  follows a private quantile of the gradient norms, set by
  `adaptive_clipping.*`, `dpjax.privacy.adaptive_clipping`), `clip_norms`
  (per-loss bounds of a model with several named losses; default
  `clip_norm` for each),
  `mechanism` ('dpsgd', or 'bandmf': banded correlated noise with cyclic
  Poisson sampling, `dpjax.privacy.bandmf`; `bands` None: the number of
  bands of least expected error at the target, else that number),
  `noise_multiplier` (None: calibrated for the target), `accountant`
  ('pld', the tighter and default, | 'rdp'), `prior_ledger` (an earlier run on the same data whose
  releases this run composes with), `pinned_secret_seed` (tests only: the
  secret noise and sampling become public, and the ledger says so).

  Optimisation: `optimizer` ('sgd' | 'adam' | 'adamw' | 'adafactor'),
  `learning_rate` (None: `learning_rate_schedule` over the run's steps), `clipping_method` ('vmap' | 'ghost' | 'auto'), `seed` (public:
  initialisation, dropout, the redaction coins; never noise or batches),
  `initial_checkpoint_path` (a Hugging Face, t5x or dpjax run directory).

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
  learning_rate: optax.ScalarOrSchedule | None = None
  seed: int = 0
  pinned_secret_seed: int | None = None
  initial_checkpoint_path: str | None = None
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
