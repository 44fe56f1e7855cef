"""What gin configures: the one module that registers dpjax's settings.

The engine (models, privacy, training, generation) takes typed records and
imports no gin. Here each record and command is registered under the name
t5x-style gin files use, so a gin file reads as it always has:

    train.batch_size = %BATCH_SIZE            # RunConfig
    train.model_config = @T5Config()          # a model's config
    T5Config.lora = @LoRAConfig()
    make_mesh.mesh_shape = {'fsdp': -1}       # RunConfig.mesh_shape
    logical_axis_rules.name = 'fsdp'          # RunConfig.axis_rules
    learning_rate_schedule.name = 'cosine'    # RunConfig.learning_rate_schedule
    adaptive_clipping.target_quantile = 0.5   # RunConfig.adaptive_clipping
    initialize.coordinator_address = ...      # the multi-host job
    generate_synthetic.top_p = 0.8            # synthetic queries

`run_config()` is the run the bindings describe, and `train()` trains it;
the command lines and pipelines call them after parsing their gin files
(`dpjax.gin_cli.configure`). The seqio tasks register their own settings
(`tasks`), as the data layer, and are registered here, at the edge, once
the bindings are parsed (`register_tasks`): the engine imports no `tasks`.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import math
from typing import Mapping

import gin
import jax

from dpjax import errors
from dpjax.generation import inference
from dpjax.models import bert, dual_encoder, gpt2, gpt2_disc, lora, t5
from dpjax.privacy.mechanisms import adaptive_clipping as adaptive_lib
from dpjax.training import distributed, reporting, run_config as run_config_lib
from dpjax.training import trainer
import tasks


def _register(cls_or_fn, name: str, **kwargs):
  """`cls_or_fn` as gin's `name`; a call of the result applies the bindings
  and returns what `cls_or_fn` returns (the record itself, not a subclass)."""
  return gin.external_configurable(cls_or_fn, name,
                                   module=cls_or_fn.__module__, **kwargs)


T5Config = _register(t5.T5Config, "T5Config")
GPT2Config = _register(gpt2.GPT2Config, "GPT2Config")
GPT2DiscConfig = _register(gpt2_disc.GPT2DiscConfig, "GPT2DiscConfig")
BertConfig = _register(bert.BertConfig, "BertConfig")
DualEncoderConfig = _register(dual_encoder.DualEncoderConfig,
                              "DualEncoderConfig")
LoRAConfig = _register(lora.LoRAConfig, "LoRAConfig")

# The fields below come from their own t5x-style names, not `train.*`.
_OWN_NAMES = ("mesh_shape", "axis_rules", "learning_rate_schedule",
              "adaptive_clipping")
_train = _register(run_config_lib.RunConfig, "train", denylist=_OWN_NAMES)
_learning_rate_schedule = _register(run_config_lib.LearningRateSchedule,
                                    "learning_rate_schedule")
_adaptive_clipping = _register(adaptive_lib.AdaptiveClipping,
                               "adaptive_clipping")
initialize = _register(distributed.initialize, "initialize")


@functools.wraps(inference.generate_synthetic)
def _generate_synthetic(**settings) -> dict:
  """`inference.generate_synthetic`, the run's tasks registered by `tasks`
  (with its recorded tokenizer files)."""
  return inference.generate_synthetic(
      **settings, register_tasks=lambda files: tasks.register_tasks(
          tokenizer_files=files))


generate_synthetic = gin.external_configurable(
    _generate_synthetic, "generate_synthetic",
    module=inference.generate_synthetic.__module__,
    denylist=["model_dir", "register_tasks"])


@gin.configurable("make_mesh", module="dpjax.training.partitioning")
def _mesh_shape(mesh_shape: Mapping[str, int] | None = None) -> dict | None:
  """`make_mesh.mesh_shape`, e.g. {'data': -1, 'fsdp': 4}."""
  return None if mesh_shape is None else dict(mesh_shape)


@gin.configurable("logical_axis_rules", module="dpjax.training.partitioning")
def _axis_rules(name: str = "data_parallel") -> str:
  """`logical_axis_rules.name`: one of `partitioning.RULE_SETS`."""
  return name


_REQUIRED = [f.name for f in dataclasses.fields(run_config_lib.RunConfig)
             if f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]
_MACROS = {"model_dir": "MODEL_DIR", "batch_size": "BATCH_SIZE",
           "mixture_or_task_name": "MIXTURE_OR_TASK_NAME",
           "task_feature_lengths": "TASK_FEATURE_LENGTHS"}


def run_config(**fields) -> run_config_lib.RunConfig:
  """The run the parsed gin bindings describe, with `fields` (RunConfig
  fields) set over them: how a pipeline derives its runs from the user's
  gin files, as typed values rather than binding strings.

  Raises:
    errors.UsageError: a required `train.*` setting is neither bound nor
      given, or an `adaptive_clipping.*` value is out of range.
  """
  missing = [name for name in _REQUIRED
             if name not in fields and not is_bound(f"train.{name}")]
  if missing:
    raise errors.UsageError("gin: not set: " + ", ".join(
        f"train.{n}" + (f" ({_MACROS[n]})" if n in _MACROS else "")
        for n in missing))
  config = _train(**{k: v for k, v in fields.items() if k not in _OWN_NAMES})
  adaptive = None
  if config.clip_norm == adaptive_lib.ADAPTIVE:
    try:
      adaptive = _adaptive_clipping()
    except ValueError as e:
      raise errors.UsageError(str(e)) from None
  own = dict(mesh_shape=_mesh_shape(), axis_rules=_axis_rules(),
             learning_rate_schedule=_learning_rate_schedule(),
             adaptive_clipping=adaptive)
  return dataclasses.replace(config, **{
      **own, **{k: v for k, v in fields.items() if k in _OWN_NAMES}})


def config_text(config: run_config_lib.RunConfig) -> str:
  """MODEL_DIR/config.gin of `config`: gin's operative config, then each
  field `config` sets over the bindings (`run_config(**fields)`) as a
  binding of its own, so the file says what was trained."""
  bound = run_config(**{n: getattr(config, n) for n in _REQUIRED})
  lines = []
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if value == getattr(bound, field.name):
      continue
    literal = _literal(value)
    if field.name in _OWN_NAMES or literal is None:
      lines.append(f"# train.{field.name}: {value!r}")
    else:
      lines.append(f"train.{field.name} = {literal}")
  text = gin.config_str()
  if lines:
    text += ("\n# Set over the bindings above (run_config's fields):\n"
             + "\n".join(lines) + "\n")
  return text


def _literal(value) -> str | None:
  """`value` as a gin (Python) literal, or None where it has none."""
  if isinstance(value, float) and math.isinf(value) and value > 0:
    return "'inf'"  # as TARGET_EPSILON spells it
  text = repr(value)
  try:
    return text if ast.literal_eval(text) == value else None
  except (ValueError, SyntaxError):
    return None


def train(config: run_config_lib.RunConfig | None = None) -> dict:
  """Trains (or resumes) `config` (default: `run_config()`), its config.gin
  `config_text(config)`; then, with `train.generate_after_training` and the
  run finished, one synthetic query per training document
  (`generate_synthetic.*`)."""
  config = config or run_config()
  register_tasks(config)
  result = trainer.train(config, config_text=lambda: config_text(config))
  if config.generate_after_training and (
      result["steps_done"] == result["steps"]):
    if jax.process_count() == 1:
      result["generation"] = generate_synthetic(model_dir=result["model_dir"])
    else:
      reporting.say("generation runs on one host: python -m dpjax.infer "
                    f"--model_dir={result['model_dir']}")
  return result


def register_tasks(config: run_config_lib.RunConfig) -> None:
  """Registers the seqio tasks `config` reads, with the vocabulary of its
  initial checkpoint (`trainer.initial_tokenizer_files`); after the gin
  files are parsed, whose bindings the tasks read."""
  tasks.register_tasks(tokenizer_files=trainer.initial_tokenizer_files(
      config.initial_checkpoint_path, config.initial_checkpoint_base_path))


def is_bound(name: str) -> bool:
  """Whether the parsed gin config binds `name` (e.g. 'train.model_dir')."""
  try:
    gin.query_parameter(name)
  except ValueError:
    return False
  return True
