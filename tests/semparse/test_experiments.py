"""The semantic-parse experiments end to end on the embedded sample, shrunk
to a few DP steps (the real tables are benchmarks, not tests)."""
from __future__ import annotations

import json
import math
import os

import pytest

from dpjax.training import trainer
from dpjax.data.readers import semparse
from dpjax.privacy import accounting
from dpjax.privacy import ledger as ledger_lib
from dpjax.pipelines.semparse import experiments, pipeline

# A few DP steps of one microbatch each: T1 = 1 and T2 = 2 on TreeDST's
# 1,723 training turns, so each stage and the composition over both count.
BATCH = 64
EPOCHS = (0.03, 0.07)
FAST = [f"BATCH_SIZE = {BATCH}", f"MICROBATCH_SIZE = {BATCH}"]
# The parsers parse nothing after 2 steps; they decode to the full target
# length, so it is short. One bucket: the trimmed microbatches keep one
# shape (each width would compile).
FAST_PARSER = ["EPOCHS = None", "TRAIN_STEPS = 2", "BATCH_SIZE = 64",
               "TASK_FEATURE_LENGTHS = {'inputs': 48, 'targets': 32}",
               "train.length_buckets = 1"]
# Every generator's rows are 32 tokens (prompts and parses cut short), so
# the DP runs of all methods share one compiled step.
SHORT = {kind: {"inputs": 8, "targets": 24} for kind in (
    "utterance_lm", "domain_to_utterance", "parse_lm", "parse_to_utterance")}
# Samples of 12 tokens: a longer sample proves nothing more here, and both
# experiments sample alike, so their decoders compile once.
MAX_TOKENS = {"utterance": 12, "parse": 12}
# The paper's smallest finite ε: its σ is larger than at ε = 8, so the
# accountant's privacy loss distributions are narrower and every
# calibration (four here) takes half the time; the claims hold at any ε.
EPS = 3.0


@pytest.fixture(scope="module")
def table(tmp_path_factory):
  out = tmp_path_factory.mktemp("semparse")
  result = experiments.generation_table(
      str(out), dataset="treedst", epsilons=(EPS,), seeds=(0,),
      epochs=EPOCHS, bindings=FAST, parser_bindings=FAST_PARSER,
      feature_lengths=SHORT, num_samples=12,
      max_tokens=MAX_TOKENS)
  return out, result


def test_two_stage_epsilon_is_one_accountant_run_over_both_stages(table):
  out, result = table
  n = len(semparse.load_turns("treedst", "train"))
  t1, t2 = (math.ceil(e * n / BATCH) for e in EPOCHS)
  run = os.path.join(out, "treedst", "2-stage", "eps3", "seed0")
  stage1 = ledger_lib.PrivacyLedger.load(
      os.path.join(run, "parse_lm", ledger_lib.LEDGER_FILENAME))
  stage2 = ledger_lib.PrivacyLedger.load(
      os.path.join(run, "parse_to_utterance", ledger_lib.LEDGER_FILENAME))
  assert (stage1.steps, stage2.steps) == (t1, t2)
  assert stage1.noise_multiplier == stage2.noise_multiplier
  direct = accounting.dpsgd_epsilon(stage1.noise_multiplier, BATCH / n,
                                    t1 + t2, 1 / (2 * n))
  assert stage2.epsilon_spent() == pytest.approx(direct, rel=1e-9)
  assert stage2.epsilon_spent() == pytest.approx(EPS, rel=1e-2)
  assert stage2.epsilon_spent() <= EPS * (1 + 1e-9)
  # The one-stage baselines spend the same budget over the same steps.
  one = [r for r in result["rows"] if r["method"] == "1-stage"][0]
  assert one["dp_steps"] == t1 + t2
  assert one["epsilon_spent"] == pytest.approx(EPS, rel=1e-2)


def test_table_has_every_method_and_metric(table):
  out, result = table
  methods = [r["method"] for r in result["rows"]]
  assert methods == ["ground truth", "1-stage", "1.5-stage", "2-stage"]
  for row in result["rows"]:
    for metric in experiments.METRICS:
      assert math.isfinite(row[metric]), (row["method"], metric)
  truth = result["rows"][0]
  assert truth["word_overlap"] == 1.0  # human utterances against themselves
  text = open(result["table_md"]).read()
  for m in ("1-stage", "1.5-stage", "2-stage", "ground truth"):
    assert f"| {m} |" in text
  synthetic = [json.loads(line) for line in open(os.path.join(
      out, "treedst", "2-stage", "eps3", "seed0", "synthetic.jsonl"))]
  assert len(synthetic) == 12
  assert all(s["prompt"].startswith("parse: ") for s in synthetic)


def test_rerun_reuses_everything(table, monkeypatch):
  out, result = table
  monkeypatch.setattr(trainer, "train", lambda: pytest.fail("retrained"))
  monkeypatch.setattr(pipeline, "generate_texts",
                      lambda *a, **k: pytest.fail("regenerated"))
  again = experiments.generation_table(
      str(out), dataset="treedst", epsilons=(EPS,), seeds=(0,),
      epochs=EPOCHS, bindings=FAST, parser_bindings=FAST_PARSER,
      feature_lengths=SHORT, num_samples=12,
      max_tokens=MAX_TOKENS)
  assert again["rows"] == result["rows"]


def test_parser_scores_against_hand_counts():
  gold = ["(Yield (WeatherQueryApi (Today)))", "(Yield (FindManager (Today)))"]
  pred = ["( Yield ( WeatherQueryApi ( Tomorrow ) ) )", "(Yield (FindManager (Today)))"]
  s = pipeline.parser_scores(pred, gold, focus=("Weather*",))
  assert s["exact_match"] == 0.5
  # pred types {Yield, WeatherQueryApi, Tomorrow} + {Yield, FindManager, Today}
  # gold types {Yield, WeatherQueryApi, Today} + {Yield, FindManager, Today}
  assert s["api_precision"] == pytest.approx(5 / 6)
  assert s["api_recall"] == pytest.approx(5 / 6)
  assert s["focus_examples"] == 1 and s["focus_exact_match"] == 0.0
  assert s["focus_api_precision"] == 1.0 and s["focus_api_recall"] == 1.0
  bad = pipeline.parser_scores(["(Yield ("], gold[:1])
  assert bad["exact_match"] == 0.0 and bad["api_precision"] == 0.0


def test_adaptation_experiment_end_to_end(tmp_path, monkeypatch):
  # Parsers trained for a few steps parse nothing; an oracle stands in for
  # their predictions (gold programs of known utterances, except an invalid
  # p0 parse of every third D_priv utterance; one fixed program for
  # synthetic ones), so the data flow is what is tested here.
  train = semparse.load_turns("smcalflow", "train")
  private = semparse.select_portion(train, "private")
  unparsable = {t.utterance for t in private[::3]}
  gold = {t.utterance: t.program for split in ("train", "validation")
          for t in semparse.load_turns("smcalflow", split)}
  calls = []

  def oracle(parser_dir, utterances, **_):
    who = os.path.basename(parser_dir)
    calls.append((who, len(utterances)))
    if who == "parser_public" and len(utterances) == len(private):
      return ["( Yield (" if u in unparsable else gold[u] for u in utterances]
    return [gold.get(u, "( Yield ( Today ) )") for u in utterances]

  monkeypatch.setattr(pipeline, "parse_utterances", oracle)
  result = experiments.adaptation_table(
      str(tmp_path), dataset="smcalflow", missing="weather", epsilon=EPS,
      methods=("1-stage", "2-stage"), epochs=EPOCHS, bindings=FAST,
      parser_bindings=FAST_PARSER, feature_lengths=SHORT, max_tokens=MAX_TOKENS,
      num_synthetic=16)
  root = tmp_path / "smcalflow_adaptation"
  rows = result["rows"]
  assert list(rows) == ["D_pub (p0)", "D_pub + D_s (1-stage, ε=3)",
                        "D_pub + D_s (2-stage, ε=3)",
                        "full training set (high-resource)"]
  test = semparse.load_turns("smcalflow", "validation")
  weather = [t for t in test if any(f.startswith("Weather")
                                    for f in t.function_types)]
  for r in rows.values():
    assert r["examples"] == len(test)
    assert r["focus_examples"] == len(weather) > 0
  # The 1-stage LM learns from every D_priv utterance, the 2-stage models
  # from the validly parsed ones; both at ε = 3 with δ = 1/(2|D_priv|).
  parsed = semparse.load_turns("smcalflow", "train",
                               str(root / "private_predicted"))
  assert [t.utterance for t in parsed] == \
      [t.utterance for t in private if t.utterance not in unparsable]
  for method, lm, n in (("1-stage", "utterance_lm", len(private)),
                        ("2-stage", "parse_to_utterance", len(parsed))):
    ledger = ledger_lib.PrivacyLedger.load(
        str(root / method / lm / ledger_lib.LEDGER_FILENAME))
    assert ledger.dataset_size == n
    assert ledger.delta == pytest.approx(1 / (2 * len(private)))
    direct = accounting.dpsgd_epsilon(
        ledger.noise_multiplier, BATCH / n,
        sum(math.ceil(e * n / BATCH) for e in EPOCHS), 1 / (2 * len(private)))
    assert ledger.epsilon_spent() == pytest.approx(direct, rel=1e-9)
    assert rows[f"D_pub + D_s ({method}, ε=3)"]["epsilon_spent"] == \
        pytest.approx(EPS, rel=1e-2)
    assert rows[f"D_pub + D_s ({method}, ε=3)"]["epsilon_spent"] <= EPS * (1 + 1e-9)
  # D_pub really lacks the functionality; D_s follows it.
  public = semparse.drop_functions(
      semparse.select_portion(train, "public"), ("Weather*",))
  augmented = semparse.load_turns(
      "smcalflow", "train", str(root / "2-stage" / "augmented_data"))
  assert [t.utterance for t in augmented[:len(public)]] == \
      [t.utterance for t in public]
  assert len(augmented) <= len(public) + 16
  assert "| D_pub (p0) |" in open(result["table_md"]).read()
  assert rows["D_pub (p0)"]["exact_match"] == 1.0  # the oracle's gold parses
  assert calls == [("parser_public", len(private)), ("parser_public", len(test)),
                   ("parser_full", 16), ("parser_augmented", len(test)),
                   ("parser_full", 16), ("parser_augmented", len(test)),
                   ("parser_full", len(test))]
