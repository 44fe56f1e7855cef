"""The domain-privacy experiment end to end on the embedded sample, shrunk to
two domains, two modes, one step per run and 2 prompts x 2 samples (the
real table is a benchmark, not a test)."""
from __future__ import annotations

import json
import math
import os

import gin
import jax
import numpy as np
import pytest

from dpjax import gin_cli
from dpjax.generation import inference
from dpjax.training import trainer
from dpjax.data.readers import multidogo
from dpjax.pipelines.dialog import experiment, lira
from dpjax.models import gpt2
from dpjax.privacy import accounting
from dpjax.privacy import ledger as ledger_lib
from dpjax.data.text import redaction

LENGTHS = {"inputs": 1, "targets": 63}
FAST = ["register_multidogo_tasks.domains = ['AIRLINE', 'MEDIA']",
        "EPOCHS = None", "TRAIN_STEPS = 1", f"TASK_FEATURE_LENGTHS = {LENGTHS!r}",
        "register_multidogo_tasks.chunk_length = 63",  # the sample's model,
        "BATCH_SIZE = 64", "MICROBATCH_SIZE = 64"]  # from its pretrained start
# A small ε, not the paper's 8: calibrating σ is cheaper the more noise it
# finds.
EPS = 1.0
ARGS = dict(modes=("domain_only", "private"), policies=("keyword",), bindings=FAST,
            epsilon=EPS, num_conversations=2, prompts_per_conversation=1,
            num_samples=2, max_new_tokens=8, batch_size=8)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("dialog"))
  yield out, experiment.domain_privacy_table(out, **ARGS)
  gin.clear_config()  # the runs' bindings (two domains) must not leak


def test_table_rows_and_files(table):
  out, result = table
  assert [(r["mode"], r["attack_policy"]) for r in result["rows"]] == [
      ("AIRLINE Only", "keyword"), ("Private", "keyword")]
  text = open(result["table_md"]).read()
  assert "| AIRLINE Only | Keyword |" in text and "| Private | Keyword |" in text
  assert open(os.path.join(out, "table.csv")).read().count("\n") == 3
  with open(result["plot"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  only, private = result["rows"]
  assert (only["dp_steps"], only["public_steps"]) == (0, 1)  # plain AdamW
  assert (private["dp_steps"], private["public_steps"]) == (1, 0)


def test_epsilon_from_the_ledger(table):
  out, result = table
  only, private = result["rows"]
  assert only["epsilon"] == math.inf  # non-private on original text
  ledger = ledger_lib.PrivacyLedger.load(os.path.join(
      out, "runs", "private", ledger_lib.LEDGER_FILENAME))
  n = ledger.dataset_size
  direct = accounting.dpsgd_epsilon(ledger.noise_multiplier, 64 / n, 1, 1 / (2 * n))
  assert private["epsilon"] == pytest.approx(direct, rel=1e-9)
  assert private["epsilon"] <= EPS * (1 + 1e-9)


def test_success_rate_recounted_from_the_generations(table):
  out, result = table
  policy = redaction.KeywordPolicy.from_json(multidogo.DEFAULT_KEYWORDS_PATH)
  for row in result["rows"]:
    gens = [json.loads(line) for line in open(os.path.join(
        out, "attacks", row["run"], "generations.jsonl"))]
    assert len(gens) == 4  # 2 prompts x 2 samples
    assert all(g["prompt"].startswith("<_soc_> <AIRLINE> ") for g in gens)
    texts = [g["text"] for g in gens if g["text"].strip()]
    leaks = sum(policy.flags(t, ["MEDIA"]) for t in texts)
    assert (row["non_empty"], row["successes"]) == (len(texts), leaks)
    if texts:
      assert row["success_rate"] == pytest.approx(leaks / len(texts))


def test_test_perplexity_against_the_models_loss(table):
  """exp of the token-weighted mean of the training loss on the test split."""
  import tasks
  from dpjax.data import arrays as data_arrays
  out, result = table
  gin.clear_config()
  gin_cli.configure(["dialog_sample.gin"], FAST)
  tasks.register_tasks()
  data = data_arrays.load_task_arrays("multidogo_lm_only_airline", "test", LENGTHS,
                                      converter="decoder_only")
  config, params, _ = inference.load_trained(os.path.join(out, "runs", "airline_only"))
  losses = np.asarray(jax.jit(gpt2.make_batch_loss(config))(params, data), np.float64)
  tokens = data["loss_weights"][:, 1:].sum(1)
  want = math.exp((losses * tokens).sum() / tokens.sum())
  assert result["rows"][0]["test_ppl_AIRLINE"] == pytest.approx(want, rel=1e-4)


def test_rerun_retrains_and_reattacks_nothing(table, monkeypatch):
  out, result = table
  monkeypatch.setattr(trainer, "train", lambda: pytest.fail("retrained"))
  monkeypatch.setattr(lira, "attack", lambda *a, **k: pytest.fail("reattacked"))
  again = experiment.domain_privacy_table(out, **ARGS)
  dump = lambda rows: json.dumps(rows, sort_keys=True)  # NaN-safe equality
  assert dump(again["rows"]) == dump(result["rows"])


def test_unknown_mode():
  with pytest.raises(ValueError, match="unknown modes"):
    experiment.target_runs("AIRLINE", ["public", "dp_sgd"], ["keyword"], 8.0)
