"""gin at the edge: `dpjax.configurables` turns the t5x-style bindings into
the typed `RunConfig` the engine takes, and nothing else reads gin."""
import dataclasses

import gin
import pytest

from dpjax import configurables, errors, gin_cli
from dpjax.models import t5
from dpjax.privacy.mechanisms import adaptive_clipping
from dpjax.training import run_config

REQUIRED = ["MODEL_DIR = 'runs/x'", "BATCH_SIZE = 8",
            "MIXTURE_OR_TASK_NAME = 't'",
            "TASK_FEATURE_LENGTHS = {'inputs': 4, 'targets': 2}",
            "train.model_dir = %MODEL_DIR", "train.batch_size = %BATCH_SIZE",
            "train.mixture_or_task_name = %MIXTURE_OR_TASK_NAME",
            "train.task_feature_lengths = %TASK_FEATURE_LENGTHS",
            "train.model_config = @T5Config()"]


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_the_bindings_by_their_t5x_names_fill_one_record():
  gin_cli.configure([], REQUIRED + [
      "T5Config.d_model = 64", "train.clip_norm = 'adaptive'",
      "make_mesh.mesh_shape = {'fsdp': -1}",
      "logical_axis_rules.name = 'fsdp'",
      "learning_rate_schedule.name = 'cosine'",
      "learning_rate_schedule.warmup_steps = 5",
      "adaptive_clipping.target_quantile = 0.7"])
  config = configurables.run_config()
  # The record built by hand from the same values, with no gin at all.
  expected = run_config.RunConfig(
      model_dir="runs/x", model_config=t5.T5Config(d_model=64),
      mixture_or_task_name="t",
      task_feature_lengths={"inputs": 4, "targets": 2}, batch_size=8,
      clip_norm="adaptive", mesh_shape={"fsdp": -1}, axis_rules="fsdp",
      learning_rate_schedule=run_config.LearningRateSchedule(
          name="cosine", warmup_steps=5),
      adaptive_clipping=adaptive_clipping.AdaptiveClipping(
          target_quantile=0.7))
  assert config == expected
  # The records are the engine's own classes, not gin's subclasses.
  assert type(config) is run_config.RunConfig
  assert type(config.model_config) is t5.T5Config


def test_defaults_without_bindings_of_their_own():
  gin_cli.configure([], REQUIRED)
  config = configurables.run_config()
  defaults = run_config.RunConfig(
      model_dir="runs/x", model_config=t5.T5Config(), mixture_or_task_name="t",
      task_feature_lengths={"inputs": 4, "targets": 2}, batch_size=8)
  assert config == defaults and config.adaptive_clipping is None
  # A fixed bound reads no adaptive_clipping.* binding.
  gin_cli.configure([], ["adaptive_clipping.target_quantile = 0.7"])
  assert configurables.run_config().adaptive_clipping is None


def test_a_missing_required_setting_names_its_binding_and_macro():
  gin_cli.configure([], [b for b in REQUIRED if "model_dir" not in b])
  with pytest.raises(errors.UsageError,
                     match=r"not set: train\.model_dir \(MODEL_DIR\)$"):
    configurables.run_config()


def test_a_setting_has_one_name():
  # mesh, rules, schedule and adaptive clipping keep their t5x names only.
  with pytest.raises(errors.UsageError, match="mesh_shape"):
    gin_cli.configure([], REQUIRED + ["train.mesh_shape = {'data': 2}"])


def test_a_bad_adaptive_setting_is_a_usage_error():
  gin_cli.configure([], REQUIRED + ["train.clip_norm = 'adaptive'",
                                    "adaptive_clipping.target_quantile = 1.5"])
  with pytest.raises(errors.UsageError, match="target_quantile must be in"):
    configurables.run_config()


def test_every_shipped_gin_file_gives_a_run_config():
  # The t5x-style files configure a run as before: each one that binds a
  # model (through its includes too) yields a record (the dry runs of
  # tests/test_dry_run.py train on some).
  import pathlib
  root = pathlib.Path(gin_cli.REPO_GIN_DIR)
  runs = 0
  for path in sorted(root.glob("*.gin")):
    gin.clear_config()
    gin_cli.configure([str(root / f) for f in OVERLAID.get(path.name, ())]
                      + [str(path)], [])
    if not configurables.is_bound("train.model_config"):
      continue  # a fragment other files include
    config = configurables.run_config()
    assert dataclasses.is_dataclass(config.model_config), path.name
    assert type(config.model_config).__module__.startswith("dpjax.models")
    runs += 1
  assert runs > 10


# Files given after another one (their header says which).
OVERLAID = {"dual_encoder_msmarco_sample.gin": ["dual_encoder_msmarco.gin"]}


def test_fields_set_over_the_bindings_as_dataclasses_replace():
  """A pipeline's runs: typed fields over the user's gin, the same record
  as `dataclasses.replace`; a required field given needs no binding."""
  gin_cli.configure([], [b for b in REQUIRED if "MODEL_DIR" not in b])
  with pytest.raises(errors.UsageError, match="MODEL_DIR"):
    configurables.run_config()
  config = configurables.run_config(model_dir="runs/y", train_steps=5,
                                    target_epsilon=float("inf"), seed=3,
                                    mesh_shape={"data": 2})
  gin.bind_parameter("train.model_dir", "runs/y")
  assert config == dataclasses.replace(
      configurables.run_config(), train_steps=5, target_epsilon=float("inf"),
      seed=3, mesh_shape={"data": 2})


def test_config_gin_says_what_was_trained(tmp_path):
  """config.gin is gin's operative config, then each field set over the
  bindings as a binding of its own: read back, it gives the same run."""
  gin_cli.configure([], REQUIRED + ["train.seed = 1"])
  config = configurables.run_config(train_steps=5, seed=3,
                                    target_epsilon=float("inf"),
                                    clip_norms={"lm": 0.5})
  text = configurables.config_text(config)
  assert "train.seed = 3" in text and "train.target_epsilon = 'inf'" in text
  assert configurables.config_text(configurables.run_config()) == \
      gin.config_str()  # nothing set over the bindings: nothing added
  path = tmp_path / "config.gin"
  path.write_text(text)
  gin.clear_config()
  gin_cli.configure([], [], run_files=[str(path)])
  assert configurables.run_config() == dataclasses.replace(
      config, target_epsilon="inf")
