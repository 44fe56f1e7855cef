"""`python -m dpjax.pretrain` on a cut-down corpus: the same command gives
the same bits, `--verify` says so (and catches a changed file), and the
release holds the run's final params under INITIAL_CHECKPOINT_PATH's
loader."""
import json

import gin
import jax
import numpy as np
import pytest

from dpjax import export, pretrain, pretrained
from dpjax.pretrain import __main__ as cli

CUT = ["--gin_file=gin/pretrain/msmarco_t5.gin", "--gin.TRAIN_STEPS=3",
       "--gin.BATCH_SIZE=8", "--gin.register_pretraining_task.max_documents=24",
       "--gin.train.eval_examples=16", "--gin.train.log_period=1"]


def _run(tmp, name, *extra):
  gin.clear_config()
  try:
    return cli.main([*CUT, f"--gin.MODEL_DIR='{tmp / ('run_' + name)}'",
                     f"--output_dir={tmp / name}", *extra])
  finally:
    gin.clear_config()


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("pretrain")
  return tmp, _run(tmp, "a"), _run(tmp, "b")


def test_same_command_same_bits(releases):
  tmp, a, b = releases
  assert a["checksums"] == b["checksums"]
  assert set(a["checksums"]) == {"config.json", "model.safetensors",
                                 "spiece.model"}
  for name, digest in a["checksums"].items():
    assert pretrain.sha256(str(tmp / "b" / name)) == digest
  assert pretrain.read_checksums(str(tmp / "a")) == a["checksums"]


def test_release_is_the_runs_final_params(releases):
  tmp, a, _ = releases
  config, params, meta = export.load_run(str(tmp / "run_a"))
  assert meta.ledger["steps"] == 0  # not one DP step
  loaded = pretrained.load_pretrained(str(tmp / "a"), config)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert pretrained.tokenizer_files(str(tmp / "a")) == {
      "sentencepiece": str(tmp / "a" / "spiece.model")}
  provenance = json.loads((tmp / "a" / pretrain.PROVENANCE_FILE).read_text())
  corpus = provenance["corpus"]
  assert set(corpus) == {"train.jsonl", "validation.jsonl"}
  assert provenance["steps"] == 3 and provenance["eval_loss"] > 0


def test_verify_passes_and_catches_a_change(releases, capsys):
  tmp, a, _ = releases
  result = _run(tmp, "a", "--verify")
  assert result["mismatched"] == []
  assert "every file matches" in capsys.readouterr().out
  sums = (tmp / "b" / pretrain.CHECKSUMS_FILE)
  text = sums.read_text()
  digest = a["checksums"]["model.safetensors"]
  sums.write_text(text.replace(digest, "0" * len(digest)))
  with pytest.raises(SystemExit) as e:
    _run(tmp, "b", "--verify")
  assert e.value.code == 1
  assert "MISMATCH in ['model.safetensors']" in capsys.readouterr().out


def test_rerun_on_a_finished_run_releases_the_same_with_its_eval_loss(
    releases):
  """The second command resumes the finished run at its end (no step, no
  eval) and releases the same bits with the first run's eval loss."""
  tmp, a, _ = releases
  again = _run(tmp, "a")
  assert again["checksums"] == a["checksums"]
  assert again["eval_loss"] == a["eval_loss"] is not None
  provenance = json.loads((tmp / "a" / pretrain.PROVENANCE_FILE).read_text())
  assert provenance["eval_loss"] == a["eval_loss"]
