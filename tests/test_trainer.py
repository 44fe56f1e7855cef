"""End-to-end behaviour of `dpjax.train` on the embedded sample (tiny T5)."""
from __future__ import annotations

import dataclasses
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
from dpjax import configurables, errors, gin_cli, verify
from dpjax.training import checkpoints, loop, sizing, step as step_lib
from dpjax.training import state as state_lib, trainer
from dpjax.data import arrays as data_arrays
from dpjax.models import gpt2, t5, trainable
from dpjax.privacy.mechanisms import multi_loss
from dpjax.privacy import accounting, ledger as ledger_lib, sampling, secret
from tests import numerics, xla_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    # From random weights: these tests compare params against their init.
    "INITIAL_CHECKPOINT_PATH = None", "T5Config.vocab_size = 2000",
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
  return configurables.train()


def initial_params():
  """The params every TINY run starts from (train.seed 0, random init)."""
  configure("unused")
  params = t5.init_params(configurables.T5Config(), jax.random.PRNGKey(0),
                          input_length=64, target_length=16)[0]
  gin.clear_config()
  return params


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


N, Q = 2998, 16 / 2998  # the sample's train split; BATCH_SIZE / N


def eight_steps_ledger(eight_steps):
  model_dir, _ = eight_steps
  return ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))


def load_ledger_json(model_dir) -> dict:
  with open(os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)) as f:
    return json.load(f)


def test_ledger_records_the_steps_delta_and_poisson_rate(eight_steps):
  ledger = eight_steps_ledger(eight_steps)
  assert ledger.steps == 8
  assert ledger.delta == pytest.approx(1 / (2 * N))
  assert ledger.sampling["method"] == "poisson"
  assert ledger.sampling["sampling_rate"] == pytest.approx(Q)


def test_epsilon_spent_equals_dp_accountings_own_pld_accountant(eight_steps):
  """PLD by default: ε spent is dp-accounting's PLDAccountant, called here
  directly, over the 8 Poisson-sampled Gaussian releases."""
  ledger = eight_steps_ledger(eight_steps)
  assert ledger.accountant == "pld"
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          Q, dp_accounting.GaussianDpEvent(ledger.noise_multiplier)), 8)
  ).get_epsilon(ledger.delta)
  assert eight_steps[1]["epsilon_spent"] == pytest.approx(direct, rel=1e-9)


def test_calibrated_sigma_spends_the_target_epsilon_within_1pc(eight_steps):
  """σ was calibrated for 8 steps at ε = 3."""
  assert 0.99 * 3.0 <= eight_steps[1]["epsilon_spent"] <= 3.0


def test_run_writes_config_summary_and_tensorboard_events(eight_steps):
  model_dir, _ = eight_steps
  for name in ("config.gin", "train_summary.json"):
    assert os.path.isfile(os.path.join(model_dir, name))
  assert os.listdir(os.path.join(model_dir, "train"))  # TensorBoard events


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compiles = {"counting": False, "events": []}


def _count_compile(event, duration, **kwargs):
  if _compiles["counting"] and event in _COMPILE_EVENTS:
    _compiles["events"].append((event, kwargs.get("fun_name")))


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def test_a_second_run_of_the_same_shapes_traces_and_compiles_nothing(
    eight_steps, tmp_path):
  """The steps and the initializer are found again in jit's cache: a run
  of the model and batch shapes of `eight_steps` (fewer steps: another σ)
  neither traces, lowers nor compiles."""
  _compiles.update(counting=True, events=[])
  try:
    result = run(tmp_path, "TRAIN_STEPS = 2")
  finally:
    _compiles["counting"] = False
  assert result["steps_done"] == 2
  assert _compiles["events"] == []


def run_killed_at(step, reference_dir, model_dir, *extra) -> None:
  """`run(model_dir, *extra)` with the secret of the run in
  `reference_dir`, killed as it samples DP step `step`."""
  original = sampling.PoissonSampler.microbatches

  def dies(self, index, m):
    if index == step:
      raise KeyboardInterrupt("killed")
    return original(self, index, m)

  same_secret(reference_dir, model_dir)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(sampling.PoissonSampler, "microbatches", dies)
    with pytest.raises(KeyboardInterrupt):
      run(model_dir, *extra)


@pytest.fixture(scope="module")
def killed(eight_steps, tmp_path_factory):
  """The 8-step run killed at step 6 (what it left behind recorded), then
  resumed to the end with the reference's secret."""
  reference_dir, _ = eight_steps
  model_dir = tmp_path_factory.mktemp("killed")
  run_killed_at(6, reference_dir, model_dir, "TRAIN_STEPS = 8")
  left = {"checkpoint_step": checkpoints.manager(str(model_dir)).latest_step(),
          "ledger_steps": ledger_lib.PrivacyLedger.load(
              os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)).steps}
  resumed = run(model_dir, "TRAIN_STEPS = 8")
  return model_dir, left, resumed


def test_killed_run_leaves_the_last_periodic_checkpoint(killed):
  _, left, _ = killed
  assert left["checkpoint_step"] == 4


def test_killed_run_leaves_a_ledger_of_the_checkpointed_steps(killed):
  _, left, _ = killed
  assert left["ledger_steps"] == 4


def test_resumed_run_spends_the_uninterrupted_epsilon(killed, eight_steps):
  _, _, resumed = killed
  assert resumed["epsilon_spent"] == eight_steps[1]["epsilon_spent"]


def test_resumed_run_writes_the_uninterrupted_ledger(killed, eight_steps):
  model_dir, _, _ = killed
  assert load_ledger_json(model_dir) == load_ledger_json(eight_steps[0])


def test_resumed_run_ends_with_the_uninterrupted_params(killed, eight_steps):
  model_dir, _, _ = killed
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               restored_params(eight_steps[0]))


def test_resumed_run_checkpoints_the_data_position_at_the_end(killed):
  model_dir, _, _ = killed
  _, meta = verify.run_meta(str(model_dir))
  assert meta.data_position.step == 8


def test_dp_steps_lower_the_loss(tmp_path):
  result = run(tmp_path, "TRAIN_STEPS = 12", "LEARNING_RATE = 1e-2",
               "train.eval_period = 12", "train.eval_examples = 128")
  configure(tmp_path)
  tasks.register_tasks()
  config = configurables.T5Config()
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


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
  """`python -m dpjax.train` on gin/quickstart.gin: 4 steps of 64 examples
  (two microbatches: accumulation is still exercised), evaluated on 64,
  then 40 synthetic queries."""
  model_dir = tmp_path_factory.mktemp("quickstart")
  proc = _cli("--gin_file=gin/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
              "--gin.TRAIN_STEPS=4", "--gin.BATCH_SIZE=64",
              "--gin.train.eval_examples=64", "--gin.train.log_period=2",
              "--gin.train.eval_period=2", "--gin.generate_synthetic.limit=40")
  return model_dir, proc


def synthetic_lines(model_dir, name):
  return (model_dir / "synthetic" / name).read_text().splitlines()


def test_quickstart_exits_0_and_reports_epsilon_and_steps(quickstart):
  _, proc = quickstart
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "ε spent" in proc.stdout and "step 4/4" in proc.stdout


def test_quickstart_writes_40_queries_with_40_qrels(quickstart):
  model_dir, _ = quickstart
  queries = synthetic_lines(model_dir, "queries.synthetic.tsv")
  qrels = synthetic_lines(model_dir, "qrels.synthetic.tsv")
  records = [json.loads(r) for r in synthetic_lines(model_dir, "synthetic.jsonl")]
  assert len(records) == 40
  written = [f"{r['qid']}\t{r['query']}" for r in records if r["query"]]
  assert queries == written and len(qrels) == len(written) >= 30


def test_empty_samples_are_recorded_but_written_as_no_query(quickstart, tmp_path,
                                                            monkeypatch):
  from dpjax.generation import decoding
  model_dir, _ = quickstart
  generate = decoding.generate

  def eos_first_in_rows_0_and_3(*args, **kwargs):
    return generate(*args, **kwargs).at[np.array([0, 3]), 0].set(1)  # EOS

  monkeypatch.setattr(decoding, "generate", eos_first_in_rows_0_and_3)
  gin.clear_config()  # no decoding or data binding left by an earlier test
  result = configurables.generate_synthetic(  # registers the run's task
      model_dir=str(model_dir), output_dir=str(tmp_path), limit=6)
  queries = (tmp_path / "queries.synthetic.tsv").read_text().splitlines()
  qrels = (tmp_path / "qrels.synthetic.tsv").read_text().splitlines()
  records = [json.loads(r) for r in
             (tmp_path / "synthetic.jsonl").read_text().splitlines()]
  assert [r["query"] for r in records if r["qid"] in (0, 3)] == ["", ""]
  assert [q.split("\t")[0] for q in queries] == [
      str(r["qid"]) for r in records if r["query"]]
  assert "0" not in [q.split("\t")[0] for q in qrels]
  assert len(records) == 6 and result["empty"] >= 2
  assert result["num_queries"] == len(queries) == len(qrels) == 6 - result["empty"]


def test_quickstart_qrels_pair_each_query_with_a_train_passage(quickstart):
  model_dir, _ = quickstart
  queries = synthetic_lines(model_dir, "queries.synthetic.tsv")
  qrels = synthetic_lines(model_dir, "qrels.synthetic.tsv")
  assert queries and qrels
  train_pids = set(tasks.load_collection_ids(tasks.DEFAULT_SAMPLE_DIR, "train"))
  for q, r in zip(queries, qrels):
    qid, text = q.split("\t")
    rqid, zero, pid, rel = r.split("\t")
    assert qid == rqid and zero == "0" and rel == "1"
    assert int(pid) in train_pids


def test_quickstart_records_decoding_epsilon_and_model_dir(quickstart):
  model_dir, _ = quickstart
  record = json.loads(synthetic_lines(model_dir, "synthetic.jsonl")[0])
  assert record["decoding"]["top_p"] == 0.8
  assert record["epsilon"] <= 3.0 and record["model_dir"] == str(model_dir)


@pytest.fixture(scope="module")
def xl_eps3_step():
  """The 3B config's DP step traced with abstract shapes (CPU cannot train
  it): the params, the accumulated grads and the applied state."""
  gin.clear_config()
  gin_cli.configure(["msmarco_t5_xl_eps3.gin"], [])
  config = sizing.with_remat(configurables.T5Config(), "layer")  # the gin's is 'auto'
  model = trainable.trainable(config, {"inputs": 384, "targets": 128})
  params, _ = model.abstract_params()
  tx, accumulate, apply = step_lib.build_dp_step(
      model, clip_norm=0.1, optimizer="adam", learning_rate=1e-3,
      noise_multiplier=1.0, normalizer=1024.0, seed=0)
  k, m = 2, 1
  batch = {
      "encoder_input_tokens": jax.ShapeDtypeStruct((k, m, 384), np.int32),
      "decoder_input_tokens": jax.ShapeDtypeStruct((k, m, 128), np.int32),
      "decoder_target_tokens": jax.ShapeDtypeStruct((k, m, 128), np.int32),
      "decoder_loss_weights": jax.ShapeDtypeStruct((k, m, 128), np.int32)}
  mask = jax.ShapeDtypeStruct((k, m), np.float32)
  grads = {multi_loss.LOSS: jax.eval_shape(step_lib.zeros_like_f32, params)}
  new_grads, metrics = jax.eval_shape(accumulate, params, grads, batch, mask,
                                      0, 0)
  state = jax.eval_shape(lambda p: state_lib.init_state(p, tx), params)
  new_state = jax.eval_shape(apply, state, new_grads,
                             secret.RunSecret.pinned(0).noise_key())
  return params, new_grads, new_state


def test_xl_eps3_config_has_about_3b_params(xl_eps3_step):
  params, _, _ = xl_eps3_step
  assert 2.8e9 < t5.param_count(params) < 3.0e9


def test_xl_eps3_accumulate_traces_to_grads_shaped_like_params(xl_eps3_step):
  params, new_grads, _ = xl_eps3_step
  assert jax.tree.structure(new_grads[multi_loss.LOSS]) == \
      jax.tree.structure(params)


def test_xl_eps3_apply_traces_to_params_of_the_same_shapes(xl_eps3_step):
  params, _, new_state = xl_eps3_step
  assert jax.tree.map(lambda a: a.shape, new_state.params) == \
      jax.tree.map(lambda a: a.shape, params)


@pytest.fixture(scope="module")
def preempted(eight_steps, tmp_path_factory):
  """The 8-step run sent SIGTERM during step 2 (its result and checkpoint
  recorded), then resumed to the end with the reference's secret."""
  reference_dir, _ = eight_steps
  model_dir = tmp_path_factory.mktemp("preempted")
  original = ledger_lib.PrivacyLedger.record_dp_steps

  # On the main thread, as step 2 records its release (the sampler runs a
  # step ahead, on another thread: `dpjax.training.prefetch`).
  def preempted_during_step_2(self, *args, **kwargs):
    if self.steps == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return original(self, *args, **kwargs)

  same_secret(reference_dir, model_dir)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ledger_lib.PrivacyLedger, "record_dp_steps",
               preempted_during_step_2)
    stopped = run(model_dir, "TRAIN_STEPS = 8")
  checkpoint_step = checkpoints.manager(str(model_dir)).latest_step()
  resumed = run(model_dir, "TRAIN_STEPS = 8")
  return model_dir, stopped, checkpoint_step, resumed


def test_sigterm_stops_after_the_step_under_way(preempted):
  _, stopped, _, _ = preempted
  assert stopped["steps_done"] == 3  # finished step 2, then checkpointed


def test_sigterm_checkpoints_at_the_step_boundary(preempted):
  _, _, checkpoint_step, _ = preempted
  assert checkpoint_step == 3


def test_run_resumed_after_sigterm_runs_to_the_last_step(preempted):
  _, _, _, resumed = preempted
  assert resumed["steps_done"] == 8


def test_run_resumed_after_sigterm_spends_the_uninterrupted_epsilon(
    preempted, eight_steps):
  _, _, _, resumed = preempted
  assert resumed["epsilon_spent"] == eight_steps[1]["epsilon_spent"]


def test_run_resumed_after_sigterm_ends_with_the_uninterrupted_params(
    preempted, eight_steps):
  model_dir, _, _, _ = preempted
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               restored_params(eight_steps[0]))


@pytest.fixture(scope="module")
def infinite_epsilon(tmp_path_factory):
  """A 2-step run at TARGET_EPSILON = inf."""
  model_dir = tmp_path_factory.mktemp("infinite_epsilon")
  return model_dir, run(model_dir, "TRAIN_STEPS = 2", "TARGET_EPSILON = 'inf'")


def test_infinite_epsilon_runs_without_noise(infinite_epsilon):
  assert infinite_epsilon[1]["noise_multiplier"] == 0.0


def test_infinite_epsilon_run_reports_infinite_epsilon_spent(infinite_epsilon):
  assert infinite_epsilon[1]["epsilon_spent"] == float("inf")


def test_infinite_epsilon_ledger_records_the_noiseless_steps(infinite_epsilon):
  model_dir, _ = infinite_epsilon
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))
  assert ledger.steps == 2 and ledger.noise_multiplier == 0.0


@pytest.fixture(scope="module")
def four_sgd_steps(tmp_path_factory):
  """A 4-step DP-SGD run on one device. Plain SGD, because Adam is invariant
  to the gradient's scale (a data-parallel sum-for-mean slip would not show)
  and amplifies rounding in near-zero coordinates to ~lr."""
  model_dir = tmp_path_factory.mktemp("sgd_one_device")
  return model_dir, run(model_dir, *SGD_STEPS)


SGD_STEPS = ("TRAIN_STEPS = 4", "OPTIMIZER = 'sgd'", "LEARNING_RATE = 1.0")


def test_data_parallel_over_two_devices_matches_one_device(four_sgd_steps,
                                                           tmp_path):
  """The same run on a 2-device mesh ('data' axis) makes the same update, up
  to the order of float32 sums across devices.

  Compared per leaf as ||Δ₂ - Δ₁|| / ||Δ₁||, Δ the update from the init:
  elementwise tolerances fail on the few coordinates where rounding of
  near-cancelling sums lands (CI saw 1.6e-6 at rtol 1e-5). Measured: the mesh
  gives ≤ 1.3e-6 here in six runs alone, up to 1.6e-5 on another CPU, and
  once 1.2e-4 inside a whole-suite run; a 0.1% change of learning rate gives
  ≥ 9.9e-4 in every leaf, so the bound 3e-4 still catches it, and a real
  slip (sum for mean over the 2 devices) moves a leaf by ~1."""
  reference_dir, _ = four_sgd_steps
  model_dir = tmp_path / "two_devices"
  env = xla_env.with_devices(2)
  bindings = [f"--gin_bindings={b}" for b in (*TINY, *SGD_STEPS)]
  same_secret(reference_dir, model_dir)
  proc = subprocess.run(
      [sys.executable, "-m", "dpjax.train", "--gin_file=quickstart.gin",
       f"--gin.MODEL_DIR={model_dir}", *bindings,
       "--gin.make_mesh.mesh_shape={'data': 2}"],
      capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  init, one = initial_params(), restored_params(reference_dir)
  # The init is the run's (train.seed 0): 4 steps move each leaf a little.
  assert all(0 < np.linalg.norm(a - i) < 0.2 * np.linalg.norm(a) for a, i in
             zip(jax.tree.leaves(one), jax.tree.leaves(init)))
  differences = numerics.update_differences(one, restored_params(model_dir),
                                            init)
  assert max(differences) < 3e-4, differences


@pytest.fixture(scope="module")
def from_pretrained(tmp_path_factory):
  """A 2-step run at learning rate 0 from INITIAL_CHECKPOINT_PATH: a Hugging
  Face export of a tiny T5 with its spiece.model. Returns the imported
  params, the checkpoint, the run's dir and the task's vocabulary file right
  after the run."""
  import seqio
  from dpjax import pretrained
  root = tmp_path_factory.mktemp("from_pretrained")
  configure(root / "unused")
  config = configurables.T5Config()
  params, _ = t5.init_params(config, jax.random.PRNGKey(7), input_length=8,
                             target_length=8)
  ckpt = root / "hf_t5"
  pretrained.export_hf(params, config, str(ckpt))
  shutil.copy(tasks.DEFAULT_VOCABULARY_PATH, ckpt / "spiece.model")
  model_dir = root / "from_pretrained"
  run(model_dir, "TRAIN_STEPS = 2", "LEARNING_RATE = 0.0",
      f"INITIAL_CHECKPOINT_PATH = '{ckpt}'")
  vocab = seqio.get_mixture_or_task("msmarco_query_generation").output_features[
      "inputs"].vocabulary
  return params, ckpt, model_dir, vocab.sentencepiece_model_file


def test_initial_checkpoint_initialises_the_params(from_pretrained):
  """With learning rate 0 the trained params stay the imported ones."""
  params, _, model_dir, _ = from_pretrained
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               params)


def test_initial_checkpoint_vocabulary_is_recorded_in_the_checkpoint(
    from_pretrained):
  _, ckpt, model_dir, _ = from_pretrained
  _, meta = verify.run_meta(str(model_dir))
  assert meta.tokenizer_files["sentencepiece"] == str(ckpt / "spiece.model")


def test_initial_checkpoint_vocabulary_becomes_the_tasks(from_pretrained):
  _, ckpt, _, vocabulary_file = from_pretrained
  assert vocabulary_file == str(ckpt / "spiece.model")


def test_a_run_starts_from_an_adapter_release_on_the_base_it_is_given(
    tmp_path):
  """An adapters-only release names its base portably ('hf_t5', not here):
  without the base's directory the run is refused in one line before
  anything is written; with train.initial_checkpoint_base_path it starts
  from the base plus the released adapters, and takes the base's
  vocabulary (learning rate 0: the params stay the loaded ones)."""
  from dpjax import export, pretrained
  from tests.models.test_lora import with_random_b
  lora = ["T5Config.lora = @LoRAConfig()", "LoRAConfig.rank = 4",
          "LoRAConfig.alpha = 8.0"]
  configure(tmp_path / "unused", *lora)
  config = configurables.T5Config()
  base_params, _ = t5.init_params(dataclasses.replace(config, lora=None),
                                  jax.random.PRNGKey(7), input_length=8,
                                  target_length=8)
  base = tmp_path / "elsewhere" / "hf_t5"
  pretrained.export_hf(base_params, config, str(base))
  shutil.copy(tasks.DEFAULT_VOCABULARY_PATH, base / "spiece.model")
  release = tmp_path / "release"
  release.mkdir()
  adapted = with_random_b(pretrained.load_pretrained(
      base, config, rng=jax.random.PRNGKey(0)))
  export.write_params(adapted, config, str(release), adapters_only=True,
                      base=export.adapter_base(config, str(base)))
  start = [*lora, "TRAIN_STEPS = 2", "LEARNING_RATE = 0.0",
           f"INITIAL_CHECKPOINT_PATH = '{release}'"]

  refused = tmp_path / "refused"
  with pytest.raises(pretrained.CheckpointError) as e:
    run(refused, *start)
  assert "'hf_t5'" in str(e.value) and "\n" not in str(e.value)
  assert "train.initial_checkpoint_base_path" in str(e.value)
  assert not refused.exists()

  model_dir = tmp_path / "from_release"
  run(model_dir, *start, f"train.initial_checkpoint_base_path = '{base}'")
  jax.tree.map(np.testing.assert_array_equal, restored_params(model_dir),
               adapted)
  _, meta = verify.run_meta(str(model_dir))
  assert meta.tokenizer_files["sentencepiece"] == str(base / "spiece.model")
  # A base path without an adapter release is a mistake, said as one.
  with pytest.raises(errors.UsageError, match="is not one"):
    run(tmp_path / "r2", f"INITIAL_CHECKPOINT_PATH = '{base}'",
        f"train.initial_checkpoint_base_path = '{base}'")


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


GPT2_ON_SAMPLE = [  # a tiny GPT-2 as a prompted LM: passage -> query
    "train.model_config = @GPT2Config()",
    "INITIAL_CHECKPOINT_PATH = None",  # the quickstart's start is a T5
    "GPT2Config.vocab_size = 2000",
    "GPT2Config.dropout_rate = 0.0",
    "TASK_FEATURE_LENGTHS = {'inputs': 48, 'targets': 16}",
]


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
  """A 30-step DP run of a tiny GPT-2 on the sample, with the model (from
  the checkpoint's config) and its initial params."""
  model_dir = tmp_path_factory.mktemp("gpt2")
  gin.clear_config()
  gin_cli.configure(["quickstart.gin", "models/gpt2_tiny.gin"],
                    [f"MODEL_DIR = '{model_dir}'", *TINY, *GPT2_ON_SAMPLE,
                     "TRAIN_STEPS = 30", "LEARNING_RATE = 1e-2",
                     "train.eval_period = 30", "train.eval_examples = 128"])
  result = configurables.train()
  config = gpt2.GPT2Config.from_json(verify.run_meta(
      str(model_dir))[1].model_config)
  model = trainable.trainable(config, {"inputs": 48, "targets": 16})
  params, _ = model.init_params(jax.random.PRNGKey(0))
  return model_dir, result, model, params


def gpt2_ledger(gpt2_run):
  return ledger_lib.PrivacyLedger.load(
      os.path.join(gpt2_run[0], ledger_lib.LEDGER_FILENAME))


def test_gpt2_ledger_records_every_step(gpt2_run):
  assert gpt2_ledger(gpt2_run).steps == 30


def test_gpt2_epsilon_equals_a_direct_dp_accounting_call(gpt2_run):
  """The same privacy plan as any model."""
  ledger = gpt2_ledger(gpt2_run)
  assert gpt2_run[1]["epsilon_spent"] == pytest.approx(
      accounting.dpsgd_epsilon(ledger.noise_multiplier, Q, 30, ledger.delta),
      rel=1e-9)


def test_gpt2_on_decoder_only_features_lowers_the_eval_loss(gpt2_run):
  """Eval loss (query tokens only) ends below the initial model's."""
  _, result, model, params = gpt2_run
  dev = data_arrays.load_task_arrays("msmarco_query_generation", "validation",
                                     {"inputs": 48, "targets": 16},
                                     converter="decoder_only")
  first = {k: v[:128] for k, v in dev.items()}
  initial = float(np.mean(model.batch_loss(params, first)))
  assert result["eval_loss"] < initial - 0.5, (result["eval_loss"], initial)


def test_gpt2_checkpoint_holds_the_models_params(gpt2_run):
  model_dir, _, _, params = gpt2_run
  restored = restored_params(model_dir)
  assert jax.tree.structure(restored) == jax.tree.structure(params)


SIGMA = 1.3  # the two stages' noise multiplier


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
  """Two runs on the same data at σ = 1.3: 3 steps, then 5 steps with
  `train.prior_ledger` the first's."""
  root = tmp_path_factory.mktemp("stages")
  stage1 = run(root / "stage1", "TRAIN_STEPS = 3",
               f"train.noise_multiplier = {SIGMA}")
  stage2 = run(root / "stage2", "TRAIN_STEPS = 5",
               f"train.noise_multiplier = {SIGMA}",
               f"train.prior_ledger = '{root / 'stage1'}'")
  return root, stage1, stage2


def test_first_stage_spends_its_own_steps(two_stages):
  _, stage1, _ = two_stages
  assert stage1["epsilon_spent"] == pytest.approx(
      accounting.dpsgd_epsilon(SIGMA, Q, 3, 1 / (2 * N)), rel=1e-9)


def test_second_stage_spends_one_accountant_run_over_both_stages(two_stages):
  _, _, stage2 = two_stages
  assert stage2["epsilon_spent"] == pytest.approx(
      accounting.dpsgd_epsilon(SIGMA, Q, 8, 1 / (2 * N)), rel=1e-9)


def test_second_stage_ledger_holds_its_steps_and_the_composed_epsilon(
    two_stages):
  root, _, stage2 = two_stages
  saved = ledger_lib.PrivacyLedger.load(
      root / "stage2" / ledger_lib.LEDGER_FILENAME)
  assert saved.steps == 5 and saved.epsilon_spent() == stage2["epsilon_spent"]


def test_missing_prior_ledger_is_a_usage_error(tmp_path):
  with pytest.raises(errors.UsageError, match="no ledger"):
    run(tmp_path / "stage3", "TRAIN_STEPS = 1",
        f"train.prior_ledger = '{tmp_path / 'missing'}'")


@pytest.fixture(scope="module")
def ghost_fsdp(eight_steps, tmp_path_factory):
  """The 8-step run with `train.clipping_method = 'ghost'` under the FSDP
  rule set and the reference's secret."""
  model_dir = tmp_path_factory.mktemp("ghost_fsdp")
  same_secret(eight_steps[0], model_dir)
  result = run(model_dir, "TRAIN_STEPS = 8", "train.clipping_method = 'ghost'",
               "logical_axis_rules.name = 'fsdp'")
  return model_dir, result


def test_ghost_clipping_and_fsdp_rules_spend_the_vmap_epsilon(ghost_fsdp,
                                                              eight_steps):
  assert ghost_fsdp[1]["epsilon_spent"] == eight_steps[1]["epsilon_spent"]


def test_ghost_clipping_and_fsdp_rules_train_the_vmap_params(ghost_fsdp,
                                                             eight_steps):
  """The same clipped sums, so the same update up to float32 sums in another
  order (ghost norms, FSDP layout), compared per leaf in norm."""
  differences = numerics.update_differences(
      restored_params(eight_steps[0]), restored_params(ghost_fsdp[0]),
      initial_params())
  assert max(differences) < 1e-3, differences


def test_unknown_clipping_method_is_a_usage_error(tmp_path):
  with pytest.raises(errors.UsageError, match="clipping_method"):
    run(tmp_path / "bad", "TRAIN_STEPS = 1", "train.clipping_method = 'fast'")


@pytest.mark.parametrize("bindings, match", [
    (["train.ghost_summation = 'fast'"], "ghost_summation must be"),
    (["train.clipping_method = 'vmap'",
      "train.ghost_summation = 'book_keeping'"], "needs ghost clipping"),
])
def test_bad_ghost_summation_is_a_usage_error(tmp_path, bindings, match):
  with pytest.raises(errors.UsageError, match=match):
    run(tmp_path / "bad", "TRAIN_STEPS = 1", *bindings)
  assert not os.path.exists(tmp_path / "bad")  # refused before writing


def test_unknown_task_is_a_usage_error_naming_the_known_ones(tmp_path):
  with pytest.raises(errors.UsageError,
                     match="MIXTURE_OR_TASK_NAME = 'no_such_task' is no "
                     "registered.*msmarco_query_gen"):
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


@pytest.fixture(scope="module")
def one_sgd_step(tmp_path_factory):
  """One real DP-SGD step at learning rate 1 and ε = 1: the ledger, the
  state the loop ends with and the update it applied (flat, float64).

  The step moves the params by -(clipped sum + N(0, σ²C²·I)) / (q·n). The
  clipped sum of ~16 examples of norm <= C spread over d coordinates has a
  per-coordinate RMS of about C/√d, so the update's standard deviation is
  σ·C/(q·n) with the ledger's σ."""
  model_dir = tmp_path_factory.mktemp("one_sgd_step")
  with pytest.MonkeyPatch.context() as mp:
    spy = FitSpy(mp)
    run(model_dir, "TRAIN_STEPS = 1", "train.optimizer = 'sgd'",
        "LEARNING_RATE = 1.0", "TARGET_EPSILON = 1.0",
        "train.accountant = 'rdp'")  # σ 0.775; PLD's 0.456 is too near the sum
  ledger = verify.run_ledger(str(model_dir))
  update = np.concatenate([
      (np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel()
      for a, b in zip(jax.tree.leaves(jax.device_get(spy.state.params)),
                      jax.tree.leaves(spy.start_params))])
  return ledger, spy.state, update


def noise_scales(one_sgd_step):
  """The update's expected noise std σ·C/(q·n) and a bound on the RMS of its
  signal (the clipped sum's share)."""
  ledger, _, update = one_sgd_step
  d, c, qn = update.size, 0.1, 16  # q·n = BATCH_SIZE
  signal_rms = 2 * c / np.sqrt(d)  # generous: up to 32 sampled examples
  return ledger.noise_multiplier * c / qn, signal_rms


def test_one_step_run_records_one_noisy_release(one_sgd_step):
  ledger, _, _ = one_sgd_step
  assert ledger.steps == 1 and ledger.noise_multiplier > 0.5


def test_a_trainer_update_carries_the_ledgers_noise(one_sgd_step):
  """The update's std is σ·C/(q·n) with the ledger's σ: a trainer that
  handed its step σ = 0, another C or another normaliser fails here, though
  every other trainer test would pass."""
  _, _, update = one_sgd_step
  expected, signal_rms = noise_scales(one_sgd_step)
  assert signal_rms < 0.1 * expected
  assert np.std(update) == pytest.approx(expected, rel=0.02)


def test_a_trainer_update_is_centred_on_the_clipped_signal(one_sgd_step):
  _, _, update = one_sgd_step
  expected, signal_rms = noise_scales(one_sgd_step)
  assert abs(np.mean(update)) < 5 * expected / np.sqrt(update.size) \
      + signal_rms


def test_a_trainer_update_counts_one_release(one_sgd_step):
  _, state, _ = one_sgd_step
  assert int(state.noise_count) == 1


@pytest.mark.parametrize("units", [
    np.array([3, 9, 4]), np.array(["ann", "bob", "added-row-1x"]),
    np.array([b"ann", b"bob", b"cy"]), np.array([b"ann", b"bob"], dtype=object)])
def test_added_rows_are_units_of_their_own(units):
  """An input audit's canary rows (`build(added_rows=...)`): each a unit
  no data row has, of a dtype the units' concatenation keeps."""
  fresh = trainer._fresh_units(units, 4)
  both = np.concatenate([units, fresh])
  assert len(fresh) == 4 and len(set(both.tolist())) == len(units) + 4
  assert both.dtype.kind == units.dtype.kind
