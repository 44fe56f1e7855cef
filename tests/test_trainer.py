"""End-to-end behaviour of `dpjax.train` on the embedded sample (tiny T5)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import dp_accounting
from dp_accounting import pld
import gin
import jax
import numpy as np
import pytest

import tasks
from dpjax import (checkpoints, gin_cli, loop, steps as steps_lib, train_step,
                   trainer)
from dpjax.data import arrays as data_arrays
from dpjax.models import gpt2, t5, trainable
from dpjax.privacy import accounting, ledger as ledger_lib, sampling, secret

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "TASK_FEATURE_LENGTHS = {'inputs': 64, 'targets': 16}",
    "BATCH_SIZE = 16",
    "MICROBATCH_SIZE = 8",
    "train.log_period = 2",
    "train.eval_period = 0",
    "train.checkpoint_period = 4",
    "train.generate_after_training = False",
]


def configure(model_dir, *extra):
  gin.clear_config()
  gin_cli.configure(["quickstart.gin"],
                    [f"MODEL_DIR = '{model_dir}'", *TINY, *extra])


def run(model_dir, *extra) -> dict:
  configure(model_dir, *extra)
  return trainer.train()


def same_secret(reference_dir, model_dir) -> None:
  """Gives `model_dir` the secret of the run in `reference_dir` (OS
  entropy), so that the two draw the same batches and noise."""
  os.makedirs(model_dir, exist_ok=True)
  shutil.copy(os.path.join(reference_dir, secret.SECRET_FILENAME), model_dir)


def restored_params(model_dir):
  mngr = checkpoints.manager(str(model_dir))
  return checkpoints.restore_params(mngr, mngr.latest_step())


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory):
  """An uninterrupted 8-step DP run (the reference for several tests)."""
  model_dir = tmp_path_factory.mktemp("uninterrupted")
  result = run(model_dir, "TRAIN_STEPS = 8")
  return model_dir, result


def test_run_writes_ledger_matching_dp_accounting(eight_steps):
  model_dir, result = eight_steps
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))
  n = 2998
  q = 16 / n
  assert ledger.steps == 8
  assert ledger.delta == pytest.approx(1 / (2 * n))
  assert ledger.sampling["method"] == "poisson"
  assert ledger.sampling["sampling_rate"] == pytest.approx(q)
  # PLD by default. σ was calibrated for 8 steps at ε = 3: ε spent equals
  # dp-accounting's own PLD accountant and reaches the target within 1%.
  assert ledger.accountant == "pld"
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(ledger.noise_multiplier)), 8)
  ).get_epsilon(ledger.delta)
  assert result["epsilon_spent"] == pytest.approx(direct, rel=1e-9)
  assert 0.99 * 3.0 <= result["epsilon_spent"] <= 3.0
  for name in ("config.gin", "train_summary.json"):
    assert os.path.isfile(os.path.join(model_dir, name))
  assert os.listdir(os.path.join(model_dir, "train"))  # TensorBoard events


def test_killed_run_resumes_to_the_uninterrupted_result(eight_steps, tmp_path,
                                                        monkeypatch):
  reference_dir, reference = eight_steps
  model_dir = tmp_path / "killed"
  original = sampling.PoissonSampler.microbatches

  def dies_at_step_6(self, step, m):
    if step == 6:
      raise KeyboardInterrupt("killed")
    return original(self, step, m)

  monkeypatch.setattr(sampling.PoissonSampler, "microbatches", dies_at_step_6)
  same_secret(reference_dir, model_dir)
  with pytest.raises(KeyboardInterrupt):
    run(model_dir, "TRAIN_STEPS = 8")
  monkeypatch.setattr(sampling.PoissonSampler, "microbatches", original)
  assert checkpoints.manager(str(model_dir)).latest_step() == 4
  assert ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)).steps == 4

  resumed = run(model_dir, "TRAIN_STEPS = 8")
  assert resumed["epsilon_spent"] == reference["epsilon_spent"]
  with open(os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)) as f:
    got = json.load(f)
  with open(os.path.join(reference_dir, ledger_lib.LEDGER_FILENAME)) as f:
    want = json.load(f)
  assert got == want
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               restored_params(reference_dir))
  _, meta = checkpoints.latest_meta(checkpoints.manager(str(model_dir)))
  assert meta.data_position.step == 8


def test_dp_steps_lower_the_loss(tmp_path):
  result = run(tmp_path, "TRAIN_STEPS = 30", "LEARNING_RATE = 1e-2",
               "train.eval_period = 30", "train.eval_examples = 128")
  configure(tmp_path)
  tasks.register_tasks()
  config = t5.T5Config()
  lengths = {"inputs": 64, "targets": 16}
  params, _ = t5.init_params(config, jax.random.PRNGKey(0),
                             input_length=lengths["inputs"],
                             target_length=lengths["targets"])
  dev = data_arrays.load_task_arrays("msmarco_query_generation", "validation",
                                     lengths)
  first = {k: v[:128] for k, v in dev.items()}
  initial = float(np.mean(t5.make_batch_loss(config)(params, first)))
  assert result["eval_loss"] < initial - 0.5, (result["eval_loss"], initial)


def test_checkpoint_of_a_different_model_is_refused(eight_steps):
  model_dir, _ = eight_steps
  before = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))
  with pytest.raises(checkpoints.CheckpointMismatchError, match="d_model"):
    run(model_dir, "TRAIN_STEPS = 8", "T5Config.d_model = 32")
  assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == before


def test_overspending_run_refuses_to_start(tmp_path):
  model_dir = tmp_path / "never_written"
  with pytest.raises(ledger_lib.BudgetExceededError, match="exceeds"):
    run(model_dir, "TRAIN_STEPS = 50", "train.noise_multiplier = 0.3",
        "TARGET_EPSILON = 1.0")
  assert not model_dir.exists()


def test_malformed_tsv_line_is_reported_and_nothing_written(tmp_path):
  data_dir = tmp_path / "msmarco"
  shutil.copytree(tasks.DEFAULT_SAMPLE_DIR, data_dir)
  path = data_dir / "queries.train.tsv"
  lines = path.read_text().splitlines(keepends=True)
  lines[9] = "not-a-number\tbroken\n"
  path.write_text("".join(lines))
  model_dir = tmp_path / "never_written"
  with pytest.raises(tasks.MalformedLineError, match="queries.train.tsv:10"):
    run(model_dir, "TRAIN_STEPS = 2", f"MSMARCO_DIR = '{data_dir}'")
  assert not model_dir.exists()


def _cli(*args, cwd=REPO):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-m", "dpjax.train", *args],
                        capture_output=True, text=True, cwd=cwd, env=env,
                        timeout=600)


@pytest.mark.parametrize("args, message", [
    (["--gin_file=no_such.gin"], "gin file not found: no_such.gin"),
    (["--gin_file=quickstart.gin", "--gin.train.no_such_flag=1"],
     "no_such_flag"),
    (["--gin_file=quickstart.gin", "--gin.MSMARCO_DIR=/no/such/dir"],
     "/no/such/dir"),
])
def test_cli_bad_input_exits_2_with_a_message(tmp_path, args, message):
  model_dir = tmp_path / "never_written"
  proc = _cli(*args, f"--gin.MODEL_DIR={model_dir}")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert message in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not model_dir.exists()


def test_quickstart_end_to_end(tmp_path):
  model_dir = tmp_path / "quickstart"
  proc = _cli("--gin_file=gin/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
              "--gin.TRAIN_STEPS=4", "--gin.train.log_period=2",
              "--gin.train.eval_period=2", "--gin.generate_synthetic.limit=40")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "ε spent" in proc.stdout and "step 4/4" in proc.stdout
  out = model_dir / "synthetic"
  queries = (out / "queries.synthetic.tsv").read_text().splitlines()
  qrels = (out / "qrels.synthetic.tsv").read_text().splitlines()
  assert len(queries) == len(qrels) == 40
  train_pids = set(tasks.load_collection_ids(tasks.DEFAULT_SAMPLE_DIR, "train"))
  for q, r in zip(queries, qrels):
    qid, text = q.split("\t")
    rqid, zero, pid, rel = r.split("\t")
    assert qid == rqid and zero == "0" and rel == "1"
    assert int(pid) in train_pids
  record = json.loads((out / "synthetic.jsonl").read_text().splitlines()[0])
  assert record["decoding"]["top_p"] == 0.8
  assert record["epsilon"] <= 3.0 and record["model_dir"] == str(model_dir)


def test_xl_eps3_train_step_builds_with_abstract_shapes():
  """The 3B config's DP step traces end to end (CPU cannot train it)."""
  gin.clear_config()
  gin_cli.configure(["msmarco_t5_xl_eps3.gin"], [])
  config = t5.T5Config()
  model = trainable.trainable(config, {"inputs": 384, "targets": 128})
  params, _ = model.abstract_params()
  assert 2.8e9 < t5.param_count(params) < 3.0e9
  tx, accumulate, apply = steps_lib.build_dp_step(
      model, clip_norm=0.1, optimizer="adam", learning_rate=1e-3,
      noise_multiplier=1.0, normalizer=1024.0, seed=0)
  k, m = 2, 1
  batch = {
      "encoder_input_tokens": jax.ShapeDtypeStruct((k, m, 384), np.int32),
      "decoder_input_tokens": jax.ShapeDtypeStruct((k, m, 128), np.int32),
      "decoder_target_tokens": jax.ShapeDtypeStruct((k, m, 128), np.int32),
      "decoder_loss_weights": jax.ShapeDtypeStruct((k, m, 128), np.int32)}
  mask = jax.ShapeDtypeStruct((k, m), np.float32)
  grads = {train_step.LOSS: jax.eval_shape(train_step.zeros_like_f32, params)}
  new_grads, metrics = jax.eval_shape(accumulate, params, grads, batch, mask,
                                      0, 0)
  assert jax.tree.structure(new_grads[train_step.LOSS]) == \
      jax.tree.structure(params)
  state = jax.eval_shape(lambda p: train_step.init_state(p, tx), params)
  new_state = jax.eval_shape(apply, state, new_grads,
                             secret.RunSecret.pinned(0).noise_key())
  assert jax.tree.map(lambda a: a.shape, new_state.params) == \
      jax.tree.map(lambda a: a.shape, params)


def test_sigterm_checkpoints_at_the_step_boundary_and_resumes(
    eight_steps, tmp_path, monkeypatch):
  reference_dir, reference = eight_steps
  model_dir = tmp_path / "preempted"
  original = sampling.PoissonSampler.microbatches

  def preempted_during_step_2(self, step, m):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return original(self, step, m)

  monkeypatch.setattr(sampling.PoissonSampler, "microbatches",
                      preempted_during_step_2)
  same_secret(reference_dir, model_dir)
  stopped = run(model_dir, "TRAIN_STEPS = 8")
  monkeypatch.setattr(sampling.PoissonSampler, "microbatches", original)
  assert stopped["steps_done"] == 3  # finished step 2, then checkpointed
  assert checkpoints.manager(str(model_dir)).latest_step() == 3
  resumed = run(model_dir, "TRAIN_STEPS = 8")
  assert resumed["steps_done"] == 8
  assert resumed["epsilon_spent"] == reference["epsilon_spent"]
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               restored_params(reference_dir))


def test_infinite_epsilon_runs_the_same_code_without_noise(tmp_path):
  result = run(tmp_path, "TRAIN_STEPS = 2", "TARGET_EPSILON = 'inf'")
  assert result["noise_multiplier"] == 0.0
  assert result["epsilon_spent"] == float("inf")
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(tmp_path, ledger_lib.LEDGER_FILENAME))
  assert ledger.steps == 2 and ledger.noise_multiplier == 0.0


def test_data_parallel_over_two_devices_matches_one_device(eight_steps,
                                                           tmp_path):
  """The same run on a 2-device mesh ('data' axis) gives the same params."""
  reference_dir, _ = eight_steps
  model_dir = tmp_path / "two_devices"
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  bindings = [f"--gin_bindings={b}" for b in TINY]
  same_secret(reference_dir, model_dir)
  proc = subprocess.run(
      [sys.executable, "-m", "dpjax.train", "--gin_file=quickstart.gin",
       f"--gin.MODEL_DIR={model_dir}", "--gin.TRAIN_STEPS=8", *bindings,
       "--gin.make_mesh.mesh_shape={'data': 2}"],
      capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Adam divides by sqrt(v): float rounding in near-zero gradients moves a
  # few params by ~1e-5 after 8 steps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4,
                                                       atol=2e-5),
               restored_params(model_dir), restored_params(reference_dir))


def test_initial_checkpoint_initialises_params_and_vocabulary(tmp_path):
  """INITIAL_CHECKPOINT_PATH: a Hugging Face export of a tiny T5 with its
  spiece.model; with learning rate 0 the trained params stay the imported
  ones exactly, and the checkpoint's vocabulary becomes the task's."""
  from dpjax import pretrained
  configure(tmp_path / "unused")
  config = t5.T5Config()
  params, _ = t5.init_params(config, jax.random.PRNGKey(7), input_length=8,
                             target_length=8)
  ckpt = tmp_path / "hf_t5"
  pretrained.export_hf(params, config, str(ckpt))
  shutil.copy(tasks.DEFAULT_VOCABULARY_PATH, ckpt / "spiece.model")
  model_dir = tmp_path / "from_pretrained"
  run(model_dir, "TRAIN_STEPS = 2", "LEARNING_RATE = 0.0",
      f"INITIAL_CHECKPOINT_PATH = '{ckpt}'")
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               params)
  _, meta = checkpoints.latest_meta(checkpoints.manager(str(model_dir)))
  assert meta.tokenizer_files["sentencepiece"] == str(ckpt / "spiece.model")
  import seqio
  vocab = seqio.get_mixture_or_task("msmarco_query_generation").output_features[
      "inputs"].vocabulary
  assert vocab.sentencepiece_model_file == str(ckpt / "spiece.model")


def test_checkpoint_of_another_architecture_is_refused_before_writing(tmp_path):
  from dpjax import pretrained
  configure(tmp_path / "unused")
  other = t5.T5Config(vocab_size=2000, d_model=32, d_kv=8, d_ff=64,
                      num_heads=4, num_encoder_layers=1, num_decoder_layers=1)
  params, _ = t5.init_params(other, jax.random.PRNGKey(0), input_length=4,
                             target_length=4)
  ckpt = tmp_path / "other_model"
  pretrained.export_hf(params, other, str(ckpt))
  model_dir = tmp_path / "never_written"
  with pytest.raises(pretrained.CheckpointError, match="d_model"):
    run(model_dir, "TRAIN_STEPS = 2", f"INITIAL_CHECKPOINT_PATH = '{ckpt}'")
  assert not model_dir.exists()


def test_infer_without_a_trained_model_exits_2_and_writes_nothing(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  model_dir = tmp_path / "no_model"
  proc = subprocess.run([sys.executable, "-m", "dpjax.infer",
                         f"--model_dir={model_dir}"], capture_output=True,
                        text=True, cwd=REPO, env=env, timeout=300)
  assert proc.returncode == 2
  assert "no checkpoint under" in proc.stderr and "Traceback" not in proc.stderr
  assert not model_dir.exists()


GPT2_ON_SAMPLE = [  # a tiny GPT-2 as a prompted LM: passage -> query
    "train.model_config = @GPT2Config()",
    "GPT2Config.vocab_size = 2000",
    "GPT2Config.dropout_rate = 0.0",
    "TASK_FEATURE_LENGTHS = {'inputs': 48, 'targets': 16}",
]


def test_gpt2_trains_on_decoder_only_features(tmp_path):
  gin.clear_config()
  gin_cli.configure(["quickstart.gin", "models/gpt2_tiny.gin"],
                    [f"MODEL_DIR = '{tmp_path}'", *TINY, *GPT2_ON_SAMPLE,
                     "TRAIN_STEPS = 30", "LEARNING_RATE = 1e-2",
                     "train.eval_period = 30", "train.eval_examples = 128"])
  result = trainer.train()
  # The same privacy plan as any model: ε from dp-accounting directly.
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(tmp_path, ledger_lib.LEDGER_FILENAME))
  assert ledger.steps == 30
  assert result["epsilon_spent"] == pytest.approx(accounting.dpsgd_epsilon(
      ledger.noise_multiplier, 16 / 2998, 30, ledger.delta, "pld"), rel=1e-9)
  # It learned: eval loss (query tokens only) below the initial model's.
  config = gpt2.GPT2Config.from_json(checkpoints.latest_meta(
      checkpoints.manager(str(tmp_path)))[1].model_config)
  model = trainable.trainable(config, {"inputs": 48, "targets": 16})
  params, _ = model.init_params(jax.random.PRNGKey(0))
  dev = data_arrays.load_task_arrays("msmarco_query_generation", "validation",
                                     {"inputs": 48, "targets": 16},
                                     converter="decoder_only")
  first = {k: v[:128] for k, v in dev.items()}
  initial = float(np.mean(model.batch_loss(params, first)))
  assert result["eval_loss"] < initial - 0.5, (result["eval_loss"], initial)
  restored = restored_params(tmp_path)
  assert jax.tree.structure(restored) == jax.tree.structure(params)


def test_second_stage_composes_with_the_first_in_one_ledger(tmp_path):
  """Two runs on the same data, the second with `train.prior_ledger`, spend
  what one accountant run over both stages' steps spends."""
  sigma = 1.3
  stage1 = run(tmp_path / "stage1", "TRAIN_STEPS = 3",
               f"train.noise_multiplier = {sigma}")
  stage2 = run(tmp_path / "stage2", "TRAIN_STEPS = 5",
               f"train.noise_multiplier = {sigma}",
               f"train.prior_ledger = '{tmp_path / 'stage1'}'")
  q, delta = 16 / 2998, 1 / (2 * 2998)
  assert stage1["epsilon_spent"] == pytest.approx(
      accounting.dpsgd_epsilon(sigma, q, 3, delta, "pld"), rel=1e-9)
  assert stage2["epsilon_spent"] == pytest.approx(
      accounting.dpsgd_epsilon(sigma, q, 8, delta, "pld"), rel=1e-9)
  saved = ledger_lib.PrivacyLedger.load(
      tmp_path / "stage2" / ledger_lib.LEDGER_FILENAME)
  assert saved.steps == 5 and saved.epsilon_spent() == stage2["epsilon_spent"]
  with pytest.raises(gin_cli.UsageError, match="no ledger"):
    run(tmp_path / "stage3", "TRAIN_STEPS = 1",
        f"train.prior_ledger = '{tmp_path / 'missing'}'")


def test_ghost_clipping_and_fsdp_rules_train_like_vmap(eight_steps, tmp_path):
  """`train.clipping_method = 'ghost'` under the FSDP rule set reproduces
  the vmap run: the same clipped sums, so the same params (float
  tolerance) and the identical ledger."""
  reference_dir, reference = eight_steps
  same_secret(reference_dir, tmp_path)
  result = run(tmp_path, "TRAIN_STEPS = 8", "train.clipping_method = 'ghost'",
               "logical_axis_rules.name = 'fsdp'")
  assert result["epsilon_spent"] == reference["epsilon_spent"]
  # Adam divides by sqrt(v): float rounding in near-zero gradients moves a
  # few params by ~1e-5 after 8 steps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4,
                                                       atol=2e-5),
               restored_params(tmp_path), restored_params(reference_dir))
  with pytest.raises(gin_cli.UsageError, match="clipping_method"):
    run(tmp_path / "bad", "TRAIN_STEPS = 1", "train.clipping_method = 'fast'")
  with pytest.raises(gin_cli.UsageError,
                     match="MIXTURE_OR_TASK_NAME = 'no_such_task' is no registered.*msmarco_query_gen"):
    run(tmp_path / "unknown", "TRAIN_STEPS = 1",
        "MIXTURE_OR_TASK_NAME = 'no_such_task'")
  assert not (tmp_path / "unknown").exists()


class FitSpy:
  """Wraps `loop.fit` as the trainer calls it: keeps the params the loop
  starts from (fetched before the first step donates them) and the state it
  ends with."""

  def __init__(self, monkeypatch):
    original = loop.fit

    def fit(state, step_fn, **kw):
      self.start_params = jax.device_get(state.params)
      self.state, done = original(state, step_fn, **kw)
      return self.state, done

    monkeypatch.setattr(loop, "fit", fit)


def test_a_trainer_update_carries_the_ledgers_noise(tmp_path, monkeypatch):
  """One real DP-SGD step at learning rate 1 moves the params by
  -(clipped sum + N(0, σ²C²·I)) / (q·n). The clipped sum of ~16 examples of
  norm <= C spread over d coordinates has a per-coordinate RMS of about
  C/√d, so the update's standard deviation is σ·C/(q·n) with the ledger's
  σ: a trainer that handed its step σ = 0, another C or another normaliser
  fails here, though every other trainer test would pass."""
  spy = FitSpy(monkeypatch)
  run(tmp_path, "TRAIN_STEPS = 1", "train.optimizer = 'sgd'",
      "LEARNING_RATE = 1.0", "TARGET_EPSILON = 1.0",
      "train.accountant = 'rdp'")  # σ = 0.775 (PLD's 0.456 is too close to the sum)
  ledger = checkpoints.run_ledger(str(tmp_path))
  assert ledger.steps == 1 and ledger.noise_multiplier > 0.5
  update = np.concatenate([
      (np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel()
      for a, b in zip(jax.tree.leaves(jax.device_get(spy.state.params)),
                      jax.tree.leaves(spy.start_params))])
  d, c, qn = update.size, 0.1, 16  # q·n = BATCH_SIZE
  expected = ledger.noise_multiplier * c / qn
  signal_rms = 2 * c / np.sqrt(d)  # generous: up to 32 sampled examples
  assert signal_rms < 0.1 * expected
  assert np.std(update) == pytest.approx(expected, rel=0.02)
  assert abs(np.mean(update)) < 5 * expected / np.sqrt(d) + signal_rms
  assert int(spy.state.noise_count) == 1
