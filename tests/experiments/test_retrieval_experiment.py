"""The retrieval experiment end to end on the embedded sample, shrunk to one
finite ε, 2 steps per run and 1-layer models (the real grid is a benchmark,
not a test)."""
from __future__ import annotations

import csv
import json
import math
import os

import pytest
from jax_privacy import auditing

from dpjax import errors
from dpjax.generation import inference
from dpjax.training import trainer
from dpjax.data.readers import msmarco
from dpjax.pipelines import harness
from dpjax.pipelines.retrieval import canaries, experiment as retrieval
from dpjax.privacy import ledger as ledger_lib

# The one finite ε (a small one: calibrating σ is cheaper the more noise it
# finds) and its name in directories and tables.
EPS = 1.0
NAME = harness.eps_name(EPS)
LIMIT = 40  # synthetic queries generated, decoded in one batch
SETTINGS = dict(
    epsilons=(EPS,), seeds=(0,), mechanisms=("dpsgd", "bandmf"),
    canary_epsilons=(EPS,), canaries_per_cell=1,
    canary_repetitions=(1, 3), num_candidates=31,
    generator_bindings=[
        "TRAIN_STEPS = 2", "BATCH_SIZE = 32", "MICROBATCH_SIZE = 32",
        "TASK_FEATURE_LENGTHS = {'inputs': 64, 'targets': 32}",
        # BandMF's band count, the most that T = 2 steps allow (DP-SGD
        # ignores it): choosing it (tests/privacy/test_bandmf.py) costs a
        # strategy optimisation and a calibration per candidate.
        "train.bands = 2",
        # The generators: 1 + 1 layers from random weights over the sample's
        # 2000 pieces (the quickstart's tests start from the shipped
        # pretrained T5), so their steps, decoding and scoring compile
        # small. Their queries are noise: nothing here measures their quality.
        "INITIAL_CHECKPOINT_PATH = None", "T5Config.vocab_size = 2000",
        "T5Config.num_encoder_layers = 1", "T5Config.num_decoder_layers = 1",
        "train.eval_period = 0", f"generate_synthetic.limit = {LIMIT}",
        f"generate_synthetic.batch_size = {LIMIT}"],
    # The dual encoders: 1 layer (trained from scratch) on 64-token
    # passages, so training, encoding the corpus and compiling stay small.
    dual_encoder_bindings=[
        "EPOCHS = None", "TRAIN_STEPS = 2", "train.eval_period = 0",
        "TASK_FEATURE_LENGTHS = {'queries': 32, 'documents': 64}",
        "T5Config.num_encoder_layers = 1"])


TRAIN_PAIRS, DEV_PAIRS = 96, 24


def _subset(out: str) -> str:
  """The first pairs of the embedded sample as an MSMARCO directory (their
  passages only), so encoding and generation stay small."""
  pids = set()
  for split, n in (("train", TRAIN_PAIRS), ("dev", DEV_PAIRS)):
    pairs = msmarco.load_query_passage_pairs(msmarco.DEFAULT_SAMPLE_DIR, split)[:n]
    pids |= {pid for _, pid, _, _ in pairs}
    with open(os.path.join(out, f"queries.{split}.tsv"), "w") as f:
      f.writelines(f"{qid}\t{q}\n" for qid, _, q, _ in pairs)
    with open(os.path.join(out, f"qrels.{split}.tsv"), "w") as f:
      f.writelines(f"{qid}\t0\t{pid}\t1\n" for qid, pid, _, _ in pairs)
  with open(os.path.join(out, "collection.tsv"), "w") as f:
    f.writelines(f"{pid}\t{p}\n" for pid, p in msmarco.read_tsv_pairs(
        os.path.join(msmarco.DEFAULT_SAMPLE_DIR, "collection.tsv"), keep_ids=pids))
  return out


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
  data = _subset(str(tmp_path_factory.mktemp("data")))
  out = str(tmp_path_factory.mktemp("retrieval"))
  return out, data, retrieval.run_experiment(out, data_dir=data, **SETTINGS)


def test_tables_and_plot_are_written(experiment):
  out, data, result = experiment
  approaches = [(r["approach"], r["epsilon"]) for r in result["rows"]]
  assert approaches == [("original", math.inf), ("synthetic", EPS),
                        ("synthetic (BandMF)", EPS), ("direct DP", EPS)]
  for row in result["rows"]:
    for m in retrieval.METRICS:
      assert 0.0 <= row[m] <= 1.0
  with open(os.path.join(out, "table.csv")) as f:
    table = list(csv.DictReader(f))
  assert [(t["approach"], t["ε"]) for t in table] == [
      ("original", "inf"), ("synthetic", NAME), ("synthetic (BandMF)", NAME),
      ("direct DP", NAME)]
  assert float(table[1]["NDCG@10"]) == pytest.approx(result["rows"][1]["ndcg@10"],
                                                     abs=1e-4)
  md = open(os.path.join(out, "table.md")).read()
  assert f"| synthetic | {NAME} |" in md and "Canary exposure" in md
  with open(os.path.join(out, "ndcg_vs_epsilon.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  lines = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))]
  assert sum(l["kind"] == "retrieval" for l in lines) == 4


def test_synthetic_pipeline_and_privacy(experiment):
  out, data, result = experiment
  run = os.path.join(out, "synthetic", f"eps{NAME}", "seed0")
  synthetic = [json.loads(l) for l in open(os.path.join(run, "synthetic",
                                                        "synthetic.jsonl"))]
  assert len(synthetic) == LIMIT  # generate_synthetic.limit from the generator gin
  # The dual encoder trained on the synthetic pairs (not the original ones).
  meta = inference.load_trained(os.path.join(run, "dual_encoder"))[2]
  assert meta.plan["dataset_size"] == math.ceil(LIMIT / 32)  # groups of 32
  for name, approach in (("generator", "synthetic"),):
    ledger = ledger_lib.PrivacyLedger.load(
        os.path.join(run, name, ledger_lib.LEDGER_FILENAME))
    assert ledger.epsilon_spent() <= EPS * (1 + 1e-9)
  for row in result["rows"][1:]:
    assert row["epsilon_spent"] == pytest.approx(EPS, rel=0.02)
  quality = result["rows"][1]
  assert 0 <= quality["bleu"] <= 100 and 0 <= quality["mauve"] <= 1


def test_bandmf_generator_is_recorded_by_its_ledger(experiment):
  """The BandMF row's generator trained with correlated noise and spent
  (within the PLD grid) the ε its ledger recomputes."""
  out, _, result = experiment
  generator = os.path.join(out, "synthetic_bandmf", f"eps{NAME}", "seed0",
                           "generator")
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(generator, ledger_lib.LEDGER_FILENAME))
  assert ledger.mechanism["name"] == "bandmf"
  assert ledger.mechanism["bands"] == 2  # correlated (1 band is DP-SGD's noise)
  row = next(r for r in result["rows"] if r["approach"] == "synthetic (BandMF)")
  assert row["epsilon_spent"] == pytest.approx(ledger.epsilon_spent())
  assert row["epsilon_spent"] <= EPS * (1 + 1e-9)


def test_unknown_mechanism_is_refused(tmp_path):
  with pytest.raises(errors.UsageError, match="mechanisms"):
    retrieval.run_experiment(str(tmp_path), mechanisms=("dpftrl",))
  assert not os.listdir(tmp_path)  # refused before anything ran


def test_canary_audit_rows(experiment):
  out, data, result = experiment
  made = canaries.load_canaries(os.path.join(out, "canaries", "data"))
  assert len(made) == 3 * 2
  per_canary = json.load(open(os.path.join(out, "canaries", f"eps{NAME}",
                                           "audit.json")))
  assert [r["secret"] for r in per_canary] == [c.secret for c in made]
  for r in per_canary:
    assert 1 <= r["sample_rank"] <= 32
    assert r["exposure"] <= math.log2(1e10) + 1e-9
  pooled = [r for r in result["canaries"] if r["kind"] == "all"]
  assert [r["repetitions"] for r in pooled] == [1, 3]
  assert all(r["epsilon_lower_bound"] >= 0 for r in pooled)
  # The one-run bound: jax-privacy's estimator on the audit's scores, at the
  # canary generator's ledger δ.
  delta = ledger_lib.PrivacyLedger.load(os.path.join(
      out, "canaries", f"eps{NAME}", ledger_lib.LEDGER_FILENAME)).delta
  for row in pooled:
    mine = [r for r in per_canary if r["repetitions"] == row["repetitions"]]
    auditor = auditing.CanaryScoreAuditor(
        [r["score"] for r in mine], [r["candidate_score"] for r in mine])
    assert row["delta"] == pytest.approx(delta, rel=1e-12)
    assert row["epsilon_lower_bound_one_run"] == pytest.approx(
        auditor.epsilon_one_run_fdp(0.05, delta), abs=1e-12)
  assert os.path.isfile(os.path.join(out, "canaries.csv"))


def test_an_incomplete_cached_value_is_computed_again(tmp_path):
  path = str(tmp_path / "audit.json")
  old = [{"score": 1.0}]
  assert retrieval._cached_json(path, lambda: old) == old
  new = [{"score": 1.0, "candidate_score": 0.5}]
  complete = lambda rows: all("candidate_score" in r for r in rows)
  assert retrieval._cached_json(path, lambda: new, complete) == new
  assert retrieval._cached_json(path, lambda: pytest.fail("recomputed"),
                                complete) == new


def test_rerun_retrains_nothing(experiment, monkeypatch):
  out, data, result = experiment
  monkeypatch.setattr(trainer, "train", lambda: pytest.fail("retrained"))
  monkeypatch.setattr(inference, "generate_synthetic",
                      lambda **_: pytest.fail("regenerated"))
  monkeypatch.setattr(canaries, "audit", lambda *a, **k: pytest.fail("re-audited"))
  again = retrieval.run_experiment(out, data_dir=data, **SETTINGS)
  assert again["rows"] == result["rows"]
  assert again["canaries"] == result["canaries"]
