"""`python -m dpjax.textcls` on a shrunken setting: both tables are written
from runs whose ledgers match, and a rerun trains, generates and classifies
nothing."""
import csv
import json
import math
import os

import pytest

from dpjax import trainer
from dpjax.privacy import accounting, ledger as ledger_lib
from dpjax.textcls import __main__ as cli, experiment

SHRUNK = ["EPOCHS = None", "TRAIN_STEPS = 2", "BATCH_SIZE = 32", "MICROBATCH_SIZE = 64",
          "GPT2Config.d_model = 16", "GPT2Config.num_layers = 1", "GPT2Config.num_heads = 2",
          "GPT2DiscConfig.head_hidden = 8", "train.log_period = 2"]
SETTINGS = experiment.Settings(samples_per_class=6, generation_batch=12, max_new_tokens=6,
                               classifier_layers=1, classifier_width=16,
                               classifier_max_tokens=16, classifier_epochs=0.5)
EPSILONS = (8.0,)


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
  assert [r[0] for r in table4[1:]] == ["8"]
  losses = [float(x) for r in table4[1:] for x in r[1:3]]
  assert all(0 < x < 2 * math.log(1507) for x in losses)  # real cross entropies
  # Each run's ledger: naive one release per step, multitask two, both at
  # the same (q, T) and ε ≤ 8 by a direct accountant call.
  for kind, releases in (("naive", 1), ("multitask", 2)):
    saved = ledger_lib.PrivacyLedger.load(os.path.join(
        experiment.run_dir(out_dir, kind, 8.0), ledger_lib.LEDGER_FILENAME))
    sigma, q = saved.noise_multiplier, 32 / 800
    direct = accounting.epsilon([accounting.PoissonGaussian(q, (sigma,) * releases, 2)],
                                1 / 800)
    assert saved.epsilon_spent() == pytest.approx(direct, rel=1e-9) and direct <= 8.0
  table1 = _csv(os.path.join(out_dir, "table1.csv"))
  assert [r[0] for r in table1] == ["variant", "original", "synthetic ε=8"]
  assert 0.0 <= float(table1[1][1]) <= 1.0 and 0.0 <= float(table1[2][1]) <= 1.0
  with open(os.path.join(out_dir, "synthetic", "pplm_eps8.tsv")) as f:
    assert len(f.read().splitlines()) == 1 + 2 * 6  # header + 6 per class
  assert os.path.isfile(os.path.join(out_dir, "table1.md"))


def test_rerun_retrains_and_regenerates_nothing(out_dir, monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("a finished run or row was redone")

  monkeypatch.setattr(trainer, "train", refuse)
  monkeypatch.setattr(experiment, "generate", refuse)
  monkeypatch.setattr(experiment, "_classifier_accuracy", refuse)
  with open(os.path.join(out_dir, "results.jsonl")) as f:
    before = f.read()
  cli.main(["table4", f"--output_dir={out_dir}", "--epsilons=8",
            *[f"--gin_bindings={b}" for b in SHRUNK]])
  experiment.table1(out_dir, epsilons=EPSILONS, bindings=SHRUNK, settings=SETTINGS)
  with open(os.path.join(out_dir, "results.jsonl")) as f:
    assert f.read() == before
  rows = [json.loads(line) for line in before.splitlines()]
  assert {r["key"] for r in rows} == {"original", "table1/8", "table4/naive/8",
                                      "table4/multitask/8"}
