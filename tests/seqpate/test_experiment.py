"""The SeqPATE Table 1 driver on a shrunken setting: the table's files agree
with each row's ledger, and a rerun trains nothing; the name-leakage metric
against a hand count."""
import csv
import dataclasses
import json
import math
import os

import pytest

from dpjax.models import gpt2
from dpjax.privacy import ledger as ledger_lib
from dpjax.seqpate import experiment, student, teachers

SETTINGS = experiment.Settings(
    model=gpt2.GPT2Config(vocab_size=1255, n_positions=48, d_model=16,
                          num_layers=1, num_heads=2, dropout_rate=0.0),
    # One learning rate: the LM steps of Pub-GPT, warm-up and Pri-GPT share
    # one compilation.
    length=24, batch_size=16, public_epochs=1, private_epochs=1,
    public_learning_rate=1e-3, private_learning_rate=1e-3, num_teachers=2,
    teacher=teachers.TeacherSetup(batch_size=16, epochs=1, learning_rate=1e-3,
                                  group_size=2, top_k=5, inference_chunk=16),
    student=student.StudentSetup(batch_size=16, warmup_epochs=1, kd_epochs=1,
                                 learning_rate=1e-3),
    max_queries=40, max_examples=48, max_test=16)
ROWS = ["Pub-GPT", "SeqPATE", "-Gaussian (no noise, eps=inf)"]


def test_name_leakage_counts_whole_names():
  generated = ["book it for Ann Lee please", "Ann Leeds called",
               "no name here", "ann lee, lower case", "Bo Li and Ann Lee"]
  # Whole words, case-sensitive: rows 0 and 4 only.
  assert experiment.name_leakage(generated, ["Ann Lee", "Bo Li"]) == 2 / 5


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("table"))
  return out, experiment.table1(out, seeds=(0,), settings=SETTINGS, rows=ROWS,
                                log=lambda _: None)


def test_table_rows_and_their_ledgers(first_run):
  out, result = first_run
  root = os.path.join(out, "airdialogue")
  with open(os.path.join(root, "results.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  assert [r["row"] for r in lines] == ROWS
  with open(os.path.join(root, "table1.csv")) as f:
    table = list(csv.DictReader(f))
  assert [r["method"] for r in table] == ROWS
  for row, line in zip(table, lines):
    assert float(row["PPL"]) == pytest.approx(line["ppl"], abs=0.006)
    assert 0 <= line["bleu4"] <= line["bleu3"] <= 100
    assert 0 <= line["name_leakage"] <= 1
  for name, line in zip(ROWS[1:], lines[1:]):
    ledger = ledger_lib.PrivacyLedger.load(os.path.join(
        root, "seed0", experiment._slug(name), ledger_lib.LEDGER_FILENAME))
    queries = sum(e.count for e in ledger.events)
    assert line["queries"] == queries <= SETTINGS.max_queries
    assert line["epsilon_spent"] == ledger.epsilon_spent()
  assert lines[1]["epsilon_spent"] <= SETTINGS.epsilon * 1.01
  assert math.isinf(lines[2]["epsilon_spent"]) and lines[2]["sigma"] == 0
  assert "∞" in open(result["table_md"]).read()


def test_rerun_trains_nothing(first_run, monkeypatch):
  out, result = first_run

  def refuse(*args, **kwargs):
    raise AssertionError("retrained on resume")

  monkeypatch.setattr(experiment, "train_lm", refuse)
  monkeypatch.setattr(teachers, "train_and_cache", refuse)
  monkeypatch.setattr(student.Student, "distill", refuse)
  again = experiment.table1(out, seeds=(0,), settings=SETTINGS, rows=ROWS,
                            log=lambda _: None)
  assert again["rows"] == json.loads(json.dumps(result["rows"]))
