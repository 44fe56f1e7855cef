"""The SeqPATE Table 1 driver on a shrunken setting: the table's files agree
with each row's ledger, NoisySGD's ledger with dp-accounting for its steps,
the user-level phrase epsilons with an explicit count, and a rerun trains
nothing; the name-leakage metric against a hand count."""
import csv
import dataclasses
import json
import math
import os
import re

import dp_accounting as dpa
from dp_accounting import pld, rdp
import numpy as np
import pytest

from dpjax.training import trainer
from dpjax.privacy import accounting as privacy_accounting
from dpjax.privacy import ledger as ledger_lib
from dpjax.pipelines.seqpate import (accounting, evaluation, experiment, partition,
                           student, teachers)

SETTINGS = experiment.Settings(  # the default model and its pretrained start
    # One learning rate: the LM steps of Pub-GPT, warm-up and Pri-GPT share
    # one compilation.
    length=24, batch_size=16, public_epochs=1, private_epochs=1,
    public_learning_rate=1e-3, private_learning_rate=1e-3,
    # Four teachers of 12 sentences, as in the user-level table: both
    # tables' teacher groups have one shape and share one compilation.
    num_teachers=4,
    teacher=teachers.TeacherSetup(batch_size=16, epochs=1, learning_rate=1e-3,
                                  group_size=2, top_k=5, inference_chunk=16),
    student=student.StudentSetup(batch_size=16, warmup_epochs=1, kd_epochs=1,
                                 learning_rate=1e-3),
    max_queries=40, max_examples=48, max_test=16,
    noisysgd_bindings=("BATCH_SIZE = 4", "EPOCHS = 1"))
ROWS = ["Pub-GPT", "NoisySGD", "SeqPATE", "-Merge_P (teacher votes)",
        "-Gaussian (Laplace)", "no noise (eps=inf)"]
TEACHER_ROWS = {"SeqPATE": ("gaussian", "distribution"),
                "-Merge_P (teacher votes)": ("gaussian", "votes"),
                "-Gaussian (Laplace)": ("laplace", "distribution")}


def test_name_leakage_counts_whole_names():
  generated = ["book it for Ann Lee please", "Ann Leeds called",
               "no name here", "ann lee, lower case", "Bo Li and Ann Lee"]
  # Whole words, case-sensitive: rows 0 and 4 only.
  assert evaluation.name_leakage(generated, ["Ann Lee", "Bo Li"]) == 2 / 5


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("table"))
  return out, experiment.table1(out, seeds=(0,), settings=SETTINGS, rows=ROWS,
                                log=lambda _: None)


def _lines_and_table(root):
  with open(os.path.join(root, "results.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  with open(os.path.join(root, "table1.csv")) as f:
    return lines, list(csv.DictReader(f))


def test_table_rows_and_their_ledgers(first_run):
  out, result = first_run
  root = os.path.join(out, "airdialogue")
  lines, table = _lines_and_table(root)
  assert [r["row"] for r in lines] == ROWS
  assert [r["method"] for r in table] == ROWS
  for row, line in zip(table, lines):
    assert float(row["PPL"]) == pytest.approx(line["ppl"], abs=0.006)
    assert 0 <= line["bleu4"] <= line["bleu3"] <= 100
    assert 0 <= line["name_leakage"] <= 1
  by_name = dict(zip(ROWS, lines))
  for name, (mechanism, aggregate) in TEACHER_ROWS.items():
    ledger = ledger_lib.PrivacyLedger.load(os.path.join(
        root, "seed0", experiment._slug(name), ledger_lib.LEDGER_FILENAME))
    queries = sum(e.count for e in ledger.events)
    line = by_name[name]
    assert line["queries"] == queries <= SETTINGS.max_queries
    assert line["epsilon_spent"] == ledger.epsilon_spent()
    assert line["epsilon_spent"] <= SETTINGS.epsilon * 1.01
    setup = accounting.ledger_setup(ledger)
    assert (setup.mechanism, setup.aggregate) == (mechanism, aggregate)
    assert {e.TYPE for e in ledger.events} == {mechanism}
  no_noise = by_name["no noise (eps=inf)"]
  assert math.isinf(no_noise["epsilon_spent"]) and no_noise["noise_scale"] == 0
  assert "∞" in open(result["table_md"]).read()


def test_noisysgd_ledger_equals_dp_accounting_for_its_steps(first_run):
  out, _ = first_run
  line = next(r for r in first_run[1]["rows"] if r["row"] == "NoisySGD")
  ledger = ledger_lib.PrivacyLedger.load(os.path.join(
      out, "airdialogue", "seed0", "noisysgd_trainer",
      ledger_lib.LEDGER_FILENAME))
  n = SETTINGS.max_examples
  q, steps = 4 / n, math.ceil(n / 4)  # BATCH_SIZE 4, one epoch
  assert ledger.sampling["method"] == "poisson"
  assert ledger.sampling["sampling_rate"] == pytest.approx(q)
  assert ledger.steps == steps == line["dp_steps"]
  assert ledger.delta == accounting.DELTA
  sigma = ledger.noise_multiplier
  assert ledger.accountant == "pld"  # the trainer's default
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(
          q, dpa.GaussianDpEvent(sigma)), steps)).get_epsilon(accounting.DELTA)
  assert line["epsilon_spent"] == ledger.epsilon_spent()
  assert line["epsilon_spent"] == pytest.approx(direct, rel=1e-9)
  assert line["epsilon_spent"] == pytest.approx(
      privacy_accounting.dpsgd_epsilon(sigma, q, steps, accounting.DELTA),
      rel=1e-12)
  assert 0.99 * SETTINGS.epsilon <= direct <= SETTINGS.epsilon * (1 + 1e-9)


def test_user_level_phrase_epsilons_equal_an_explicit_count(tmp_path):
  settings = dataclasses.replace(SETTINGS, partition="user", num_teachers=4)
  result = experiment.table1(str(tmp_path), seeds=(0,), settings=settings,
                             rows=["SeqPATE"], log=lambda _: None)
  (line,) = result["rows"]
  private = experiment.load_splits("airdialogue", settings, 0)["private"]
  assignment = partition.user_partition([e.user_id for e in private], 4, 0)
  names = sorted({e.user_id for e in private})
  # Teachers holding a text with the full name as whole words.
  counts = np.array([len({t for e, t in zip(private, assignment) if re.search(
      rf"(?<!\w){re.escape(name)}(?!\w)", e.text)}) for name in names])
  assert counts.max() > 1  # the scaling with n_s is exercised
  ledger = ledger_lib.PrivacyLedger.load(os.path.join(
      tmp_path, "airdialogue-user", "seed0", "seqpate",
      ledger_lib.LEDGER_FILENAME))
  sigma, queries = accounting.ledger_setup(ledger).scale, line["queries"]
  eps = [rdp.RdpAccountant(orders=privacy_accounting.RDP_ORDERS).compose(
      dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(
          sigma / (math.sqrt(2) * c)), queries)).get_epsilon(accounting.DELTA)
         for c in counts if c]
  summary = line["phrase_epsilon"]
  assert summary["phrases"] == len(eps)
  assert summary["epsilon_min"] == pytest.approx(min(eps), rel=1e-9)
  assert summary["epsilon_avg"] == pytest.approx(np.mean(eps), rel=1e-9)
  assert summary["epsilon_max"] == pytest.approx(max(eps), rel=1e-9)
  header = open(result["table_md"]).read()
  assert "phrase ε avg" in header and f"{max(eps):.2f}" in header


def test_rerun_trains_nothing(first_run, monkeypatch):
  out, result = first_run

  def refuse(*args, **kwargs):
    raise AssertionError("retrained on resume")

  monkeypatch.setattr(experiment, "train_lm", refuse)
  monkeypatch.setattr(teachers, "train_and_cache", refuse)
  monkeypatch.setattr(student.Student, "distill", refuse)
  monkeypatch.setattr(trainer, "train", refuse)
  again = experiment.table1(out, seeds=(0,), settings=SETTINGS, rows=ROWS,
                            log=lambda _: None)
  assert again["rows"] == json.loads(json.dumps(result["rows"]))


def test_a_table_refuses_other_settings(first_run):
  """Rerunning into a table's directory with another ε (or any setting) is
  refused, naming the field, before anything is trained or reused."""
  from dpjax.training import checkpoints
  out, _ = first_run
  other = dataclasses.replace(SETTINGS, epsilon=SETTINGS.epsilon + 1)
  with pytest.raises(checkpoints.CheckpointMismatchError, match="epsilon"):
    experiment.table1(out, seeds=(0,), settings=other, rows=ROWS, log=lambda _: None)


@pytest.mark.parametrize("flag, expected", [
    ([], experiment.Settings().initial_checkpoint),
    (["--initial_checkpoint=none"], None),
    (["--initial_checkpoint=some/gpt2"], os.path.abspath("some/gpt2"))])
def test_initial_checkpoint_flag_sets_pub_gpts_start(monkeypatch, tmp_path,
                                                     flag, expected):
  from dpjax.pipelines.seqpate import __main__ as cli
  seen = {}

  def table1(output_dir, *, settings, **_):
    seen["settings"] = settings
    (tmp_path / "table1.md").write_text("")
    return {"table_md": str(tmp_path / "table1.md")}

  monkeypatch.setattr(experiment, "table1", table1)
  cli.main(["table1", f"--output_dir={tmp_path}", *flag])
  assert seen["settings"].initial_checkpoint == expected


def test_default_start_is_the_shipped_seqpate_gpt2_of_the_default_model():
  path = experiment.Settings().initial_checkpoint
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  model = experiment.Settings().model
  assert path.endswith(os.path.join("pretrained", "seqpate_gpt2"))
  assert (config["vocab_size"], config["n_positions"], config["n_embd"],
          config["n_layer"]) == (model.vocab_size, model.n_positions,
                                 model.d_model, model.num_layers)
