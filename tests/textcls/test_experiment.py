"""`python -m dpjax.pipelines.textcls` on a shrunken setting: both tables are written
from runs whose ledgers match, the baseline pipeline (naive LM, then a
post-hoc head on it frozen) is one budget and trains only the head, and a
rerun trains, generates and classifies nothing."""
import csv
import json
import math
import os

import dp_accounting
import gin
import jax
import numpy as np
import pytest
from dp_accounting import pld

from dpjax.training import checkpoints, trainer
from dpjax import configurables
from dpjax import errors, gin_cli, verify
from dpjax.models import gpt2_disc, trainable
from dpjax.privacy import accounting, ledger as ledger_lib
from dpjax.pipelines.textcls import __main__ as cli, experiment
from dpjax.pipelines.harness import eps_name

# Few steps and a small head; the GPT-2 is the sample's, from its pretrained
# start (gin/textcls_sample.gin).
N, BATCH = 800, 32  # the sample's train split; examples expected a step
SHRUNK = ["EPOCHS = None", "TRAIN_STEPS = 2", f"BATCH_SIZE = {BATCH}", "MICROBATCH_SIZE = 64",
          "GPT2DiscConfig.head_hidden = 8", "train.log_period = 2"]
SETTINGS = experiment.Settings(samples_per_class=6, generation_batch=12, max_new_tokens=6,
                               classifier_layers=1, classifier_width=16,
                               classifier_max_tokens=16, classifier_epochs=0.5)
# The one ε (a small one: calibrating σ is cheaper the more noise it finds)
# and its name in directories, tables and result keys.
EPS = 1.0
EPSILONS = (EPS,)
NAME = eps_name(EPS)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("textcls"))
  experiment.table4(out, epsilons=EPSILONS, bindings=SHRUNK)
  experiment.table1(out, epsilons=EPSILONS, bindings=SHRUNK, settings=SETTINGS)
  return out


def _csv(path):
  with open(path) as f:
    return list(csv.reader(f))


def test_tables_are_written_from_runs_with_matching_ledgers(out_dir):
  table4 = _csv(os.path.join(out_dir, "table4.csv"))
  assert [r[0] for r in table4[1:]] == [NAME]
  losses = [float(x) for r in table4[1:] for x in r[1:3]]
  assert all(0 < x < 2 * math.log(1507) for x in losses)  # real cross entropies
  # Each run's ledger: naive one release per step, multitask two, both at
  # the same (q, T) and ε ≤ EPS by a direct accountant call.
  for kind, releases in (("naive", 1), ("multitask", 2)):
    saved = ledger_lib.PrivacyLedger.load(os.path.join(
        experiment.run_dir(out_dir, kind, EPS), ledger_lib.LEDGER_FILENAME))
    sigma, q = saved.noise_multiplier, BATCH / N
    direct = accounting.epsilon([accounting.PoissonGaussian(q, (sigma,) * releases, 2)],
                                1 / N)
    assert saved.epsilon_spent() == pytest.approx(direct, rel=1e-9) and direct <= EPS
  table1 = _csv(os.path.join(out_dir, "table1.csv"))
  assert table1[0][1:4] == ["ours (multitask + PPLM)", "baseline 2 (post-hoc disc + PPLM)",
                            "baseline 1 (filtered)"]
  assert [r[0] for r in table1] == ["variant", "original", f"synthetic ε={NAME}"]
  assert 0.0 <= float(table1[1][1]) <= 1.0
  assert all(0.0 <= float(x) <= 1.0 for x in table1[2][1:3])
  kept = int(table1[2][4])
  for name, rows in (("pplm", 2 * 6), ("posthoc_pplm", 2 * 6), ("filtered", kept)):
    with open(os.path.join(out_dir, "synthetic", f"{name}_eps{NAME}.tsv")) as f:
      assert len(f.read().splitlines()) == 1 + rows  # header + the texts
  assert os.path.isfile(os.path.join(out_dir, "table1.md"))


def _ledger(out_dir, kind):
  return ledger_lib.PrivacyLedger.load(os.path.join(
      experiment.run_dir(out_dir, kind, EPS), ledger_lib.LEDGER_FILENAME))


def _params(out_dir, kind):
  mngr, step, _ = verify.read_run(experiment.run_dir(out_dir, kind, EPS))
  return checkpoints.restore_params(mngr, step)


def test_baseline_pipeline_ledger_counts_both_trainings(out_dir):
  """The head run's ledger (the pipeline's ε) = dp_accounting's PLD ε of
  T1 = 2 LM steps then T2 = 2 head steps, one Gaussian each at q = 32/800,
  with the one σ both runs used; it meets ε = EPS and exceeds the LM's alone."""
  lm, head = _ledger(out_dir, "baseline_lm"), _ledger(out_dir, "baseline_disc")
  sigma, q, delta = head.noise_multiplier, BATCH / N, 1 / N
  assert lm.noise_multiplier == sigma and (lm.steps, head.steps) == (2, 2)
  step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
  assert head.accountant == "pld"
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(step, 2),
                                     dp_accounting.SelfComposedDpEvent(step, 2)])
  ).get_epsilon(delta)
  assert head.epsilon_spent() == pytest.approx(direct, rel=1e-9)
  assert lm.epsilon_spent() < direct <= EPS * (1 + 1e-9)
  assert direct == pytest.approx(EPS, rel=0.02)  # σ calibrated for T1 + T2, not T1
  row = experiment._read_results(out_dir)[f"table1/baselines/{NAME}"]
  assert row["epsilon_spent"] == pytest.approx(direct, rel=1e-9) and row["steps"] == [2, 2]


def test_head_only_run_changes_only_the_head(out_dir):
  lm, head = _params(out_dir, "baseline_lm"), _params(out_dir, "baseline_disc")
  assert set(head) == set(lm) | {gpt2_disc.HEAD}
  jax.tree.map(np.testing.assert_array_equal, gpt2_disc.lm_params(head), lm)
  moved = jax.tree.map(lambda a, b: not np.allclose(a, b), head[gpt2_disc.HEAD],
                       _head_init(_head_config(out_dir), seed=0))  # the run's seed
  assert all(jax.tree.leaves(moved))  # every head leaf trained (noise alone moves it)


def _head_config(out_dir):
  _, _, meta = verify.read_run(experiment.run_dir(out_dir, "baseline_disc", EPS))
  return trainable.config_from_json(meta.model_class, meta.model_config)


def _head_init(config, seed):
  """The head of `gpt2_disc.init_params` (rows of 3 + 32 tokens), jitted: an
  eager init of the whole model is slow."""
  return jax.jit(lambda: gpt2_disc.init_params(config, jax.random.PRNGKey(seed),
                                               max_length=35)[0][gpt2_disc.HEAD])()


def test_init_from_run_reads_the_lm_and_initialises_the_head(out_dir):
  """`checkpoints.init_from_run` of the head model from the LM run: the GPT-2
  subtrees are the LM run's saved params, the head is the model's own init
  at the given seed."""
  config = _head_config(out_dir)
  model = trainable.trainable(config, {"inputs": 3, "targets": 32})
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: device, model.abstract_params()[0])
  mngr, step, _ = verify.read_run(experiment.run_dir(out_dir, "baseline_lm", EPS))
  params = checkpoints.init_from_run(model, mngr, step, shardings, seed=3)
  jax.tree.map(np.testing.assert_array_equal, gpt2_disc.lm_params(params),
               _params(out_dir, "baseline_lm"))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               params[gpt2_disc.HEAD], _head_init(config, seed=3))


def test_a_head_on_another_gpt2_is_refused_before_writing(out_dir, tmp_path):
  never = tmp_path / "never_written"
  gin.clear_config()
  try:
    gin_cli.configure(list(experiment.DEFAULT_GIN_FILES), [
        *SHRUNK, "GPT2Config.d_model = 32", "GPT2DiscConfig.head_only = True",
        f"MODEL_DIR = '{never}'", "train.clip_norms = None",
        f"train.initial_checkpoint_path = "
        f"'{experiment.run_dir(out_dir, 'baseline_lm', EPS)}'"])
    with pytest.raises(checkpoints.CheckpointMismatchError, match="d_model"):
      configurables.train()
  finally:
    gin.clear_config()
  assert not never.exists()


def test_rerun_retrains_and_regenerates_nothing(out_dir, monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("a finished run or row was redone")

  monkeypatch.setattr(trainer, "train", refuse)
  monkeypatch.setattr(experiment, "generate", refuse)
  monkeypatch.setattr(experiment, "_classifier_accuracy", refuse)
  with open(os.path.join(out_dir, "results.jsonl")) as f:
    before = f.read()
  cli.main(["table4", f"--output_dir={out_dir}", f"--epsilons={NAME}",
            *[f"--gin_bindings={b}" for b in SHRUNK]])
  experiment.table1(out_dir, epsilons=EPSILONS, bindings=SHRUNK, settings=SETTINGS)
  with open(os.path.join(out_dir, "results.jsonl")) as f:
    assert f.read() == before
  rows = [json.loads(line) for line in before.splitlines()]
  assert {r["key"] for r in rows} == {"original", f"table1/{NAME}",
                                      f"table1/baselines/{NAME}",
                                      f"table4/naive/{NAME}",
                                      f"table4/multitask/{NAME}"}


def test_task_data_follows_the_gin_task_files_and_vocabulary(tmp_path):
  """Table 1 reads the texts, dataset and vocabulary of the gin task, not the
  embedded sample's: a data directory and another dataset given by binding."""
  sst2 = tmp_path / "sst2"
  sst2.mkdir()
  (sst2 / "train.tsv").write_text("sentence\tlabel\na fine film .\t1\na dull one .\t0\n")
  (sst2 / "dev.tsv").write_text("sentence\tlabel\nquite good .\t1\n")
  data = experiment.task_data(bindings=[f"register_textcls_tasks.sst2_dir = '{sst2}'"])
  assert data.dataset == "sst2"
  assert [(e.text, e.label) for e in data.train] == [("a fine film .", 1), ("a dull one .", 0)]
  assert [(e.text, e.label) for e in data.test] == [("quite good .", 1)]
  # The runs' vocabulary: the sample BPE plus the extra tokens, each one id.
  assert data.vocabulary.tokenizer.get_vocab_size() == 1500 + 7
  assert data.vocabulary.encode("<|positive|><|sep|>") == [1502, 1500]
  news = experiment.task_data(bindings=["MIXTURE_OR_TASK_NAME = 'ag_news_conditional_lm'"])
  assert news.dataset == "ag_news" and {e.label for e in news.train} == {0, 1, 2, 3}
  with pytest.raises(errors.UsageError, match="label-conditioned"):
    experiment.task_data(bindings=["MIXTURE_OR_TASK_NAME = 'multidogo_lm'"])
