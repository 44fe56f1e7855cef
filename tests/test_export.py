"""`python -m dpjax.export` on one tiny T5 run: the release round-trips, its
ε is dp-accounting's for the ledger's (q, σ, steps), it holds no seed and no
secret file, and every refusal writes nothing."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tasks
from dpjax import configurables, export, gin_cli, pretrained, verify
from dpjax.models import dual_encoder, t5
from dpjax.privacy import accounting, secret as secret_lib
from tests import console, test_trainer

SEED = 918273645  # distinctive: the scan below looks for its bytes
PINNED = 736451829  # train.pinned_secret_seed: the run's secret is public
N = 2998  # the embedded sample's training examples (tests/test_trainer.py)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """Two DP steps of a tiny T5 started from a Hugging Face export with its
  spiece.model (so the run records tokenizer files), its secret pinned, plus
  one more secret file."""
  tmp = tmp_path_factory.mktemp("export")
  test_trainer.configure(tmp / "unused")
  config = configurables.T5Config()  # the tiny run's, as gin binds it
  params, _ = t5.init_params(config, jax.random.PRNGKey(3),
                             input_length=8, target_length=8)
  ckpt = tmp / "hf_t5"
  pretrained.export_hf(params, config, str(ckpt))
  shutil.copy(tasks.DEFAULT_VOCABULARY_PATH, ckpt / "spiece.model")
  model_dir = tmp / "run"
  test_trainer.run(model_dir, "TRAIN_STEPS = 2", f"train.seed = {SEED}",
                   f"train.pinned_secret_seed = {PINNED}",
                   f"INITIAL_CHECKPOINT_PATH = '{ckpt}'")
  (model_dir / "secret.key").write_bytes(os.urandom(32))
  return model_dir


@pytest.fixture(scope="module")
def release(run_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("releases") / "r"
  return out, export.main([f"--model_dir={run_dir}", f"--output_dir={out}"])


def _meta(model_dir):
  return verify.run_meta(str(model_dir))


def test_release_round_trips_and_states_the_recomputed_epsilon(run_dir,
                                                               release):
  out, result = release
  assert sorted(os.listdir(out)) == sorted(result["files"]) == sorted([
      "config.json", "model.safetensors", "dpjax_config.json", "spiece.model",
      "privacy_statement.json", "PRIVACY.md"])
  released = json.loads((out / "dpjax_config.json").read_text())
  assert released["model_class"] == "T5Config"
  config = t5.T5Config.from_json(released["model_config"])
  got = pretrained.load_pretrained(str(out), config)
  want = test_trainer.restored_params(run_dir)
  jax.tree.map(lambda a, b: (np.testing.assert_array_equal(a, b),
                             np.testing.assert_equal(a.dtype, b.dtype)),
               got, want)
  assert pretrained.tokenizer_files(out) == {
      "sentencepiece": str(out / "spiece.model")}
  assert ((out / "spiece.model").read_bytes()
          == open(tasks.DEFAULT_VOCABULARY_PATH, "rb").read())

  s = json.loads((out / "privacy_statement.json").read_text())
  step, meta = _meta(run_dir)
  ledger = meta.ledger
  assert s["dp_steps"] == s["model_step"] == step == 2
  assert s["dataset_size"] == N and s["delta"] == pytest.approx(1 / (2 * N))
  assert s["sampling_rate"] == pytest.approx(16 / N)
  assert s["noise_multiplier"] == ledger["noise_multiplier"] > 0
  assert s["clip_norm"] == ledger["clip_norm"]
  direct = accounting.dpsgd_epsilon(s["noise_multiplier"], 16 / N, 2,
                                    1 / (2 * N))
  assert s["epsilon"] == pytest.approx(direct, rel=1e-9)
  assert (s["unit_of_privacy"], s["adjacency"], s["sampling"]["method"]) == (
      "one training example", "add_or_remove_one", "poisson")
  assert s["target_epsilon"] == 3.0 and s["accountant"] == "pld"
  assert s["noise_key"] == ledger["secret"] == "pinned"
  assert s["audit"] is None  # no --audit (tests/audit/test_audit.py)
  text = (out / "PRIVACY.md").read_text()
  assert f"{s['epsilon']:.4g}" in text and "## Audit" not in text
  assert "WARNING: the noise key was pinned" in text.splitlines()[2]


def test_release_holds_no_seed_and_no_secret(run_dir, release):
  out, _ = release
  _, meta = _meta(run_dir)
  assert meta.plan["seed"] == meta.data_position.seed == SEED
  needles = [str(seed).encode() for seed in (SEED, PINNED)]
  needles += [struct.pack(f"{e}{w}", seed) for seed in (SEED, PINNED)
              for e in "<>" for w in "iq"]
  secrets = [p for p in run_dir.iterdir() if "secret" in p.name.lower()]
  assert len(secrets) == 2  # the trainer's and the fixture's
  for p in secrets:
    content = p.read_bytes()
    needles += [content, content.strip(), content.hex().encode()]
  run_secret = secret_lib.RunSecret.load(str(run_dir))  # and what it keys
  needles += [run_secret.key, run_secret.key.hex().encode(),
              run_secret.noise_key().tobytes(),
              str(run_secret.sampling_seed()).encode(),
              run_secret.purpose_key("sampling")]
  for root, _, names in os.walk(out):
    for name in names:
      assert not any(w in name.lower() for w in ("secret", "key", "seed",
                                                 "gin", "summary", "meta"))
      blob = open(os.path.join(root, name), "rb").read()
      for needle in needles:
        assert needle not in blob, (name, needle[:16])


def test_statement_recomputes_epsilon_and_warns_of_a_pinned_key(run_dir):
  _, meta = _meta(run_dir)
  meta = dataclasses.replace(meta, ledger=dict(meta.ledger, epsilon_spent=0.0,
                                               secret="pinned"))
  s = export.privacy_statement(meta, t5.T5Config())
  assert s["epsilon"] > 0.5  # not the stored number
  assert s["noise_key"] == "pinned" and s["guarantee_excludes"]
  text = export.privacy_markdown(s)
  assert "WARNING: the noise key was pinned" in text.splitlines()[2]
  meta.ledger["secret"] = "os_entropy"
  s = export.privacy_statement(meta, t5.T5Config())
  assert s["guarantee_excludes"] is None
  assert "WARNING" not in export.privacy_markdown(s)


def test_unit_of_privacy_of_the_dual_encoder():
  config = dual_encoder.DualEncoderConfig(group_size=4)
  shuffle = {"sampling": {"method": "shuffle", "adjacency": "replace_one"}}
  assert export.unit_and_adjacency(shuffle, config, None) == (
      "one (query, passage) pair", "replace_one")
  unit, adjacency = export.unit_and_adjacency(
      {"sampling": {"method": "poisson"}}, config, None)
  assert "group of 4" in unit and adjacency == "add_or_remove_one"
  assert export.unit_and_adjacency(
      dict(shuffle, unit="one user", adjacency="zero_out"), config, None) == (
          "one user", "zero_out")
  assert "group_seed" not in json.dumps(export.public_config(config.to_json()))


def test_params_without_a_hugging_face_mapping_are_flat_safetensors(
    tmp_path):
  from safetensors import numpy as st_numpy
  params = {"encoder": {"layers_0": {"kernel": np.arange(6.0).reshape(2, 3)}},
            "token_embedder": {"embedding": np.ones((4, 2), jnp.bfloat16)}}
  names = export.write_params(params, dual_encoder.DualEncoderConfig(),
                              str(tmp_path))
  assert names == ["params.safetensors"] == os.listdir(tmp_path)
  got = st_numpy.load_file(str(tmp_path / "params.safetensors"))
  assert sorted(got) == ["encoder/layers_0/kernel",
                         "token_embedder/embedding"]
  for name, want in (("encoder/layers_0/kernel", params["encoder"]["layers_0"][
      "kernel"]), ("token_embedder/embedding",
                   params["token_embedder"]["embedding"])):
    assert got[name].dtype == want.dtype
    np.testing.assert_array_equal(got[name], want)


def _refused(capsys, *argv) -> str:
  with pytest.raises(SystemExit) as e:
    gin_cli.exit_on_user_error(lambda: export.main(list(argv)))
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1
  return err


def test_refusals_write_nothing(run_dir, tmp_path, capsys):
  empty = tmp_path / "empty_run"
  (empty / "checkpoints").mkdir(parents=True)
  assert "no checkpoint" in _refused(capsys, f"--model_dir={empty}",
                                     f"--output_dir={tmp_path / 'a'}")
  inside = run_dir / "release"
  assert "outside" in _refused(capsys, f"--model_dir={run_dir}",
                               f"--output_dir={inside}")
  taken = tmp_path / "taken"
  taken.mkdir()
  (taken / "mine.txt").write_text("keep")
  assert "--overwrite" in _refused(capsys, f"--model_dir={run_dir}",
                                   f"--output_dir={taken}")
  assert not inside.exists() and not (tmp_path / "a").exists()
  assert os.listdir(taken) == ["mine.txt"]
  assert sorted(os.listdir(tmp_path)) == ["empty_run", "taken"]  # no temp dir

  assert "not an earlier dpjax release (it holds mine.txt)" in _refused(
      capsys, f"--model_dir={run_dir}", f"--output_dir={taken}",
      "--overwrite")
  assert os.listdir(taken) == ["mine.txt"]
  assert sorted(os.listdir(tmp_path)) == ["empty_run", "taken"]


def test_overwrite_replaces_a_release_and_refuses_a_run(run_dir, release,
                                                        tmp_path, capsys):
  """--overwrite on another run's directory deleted its checkpoints and
  secret; it now replaces only an earlier release."""
  other = tmp_path / "other_run"
  shutil.copytree(run_dir, other)
  before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
  assert "holds a dpjax run" in _refused(
      capsys, f"--model_dir={run_dir}", f"--output_dir={other}", "--overwrite")
  assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before

  old = tmp_path / "old_release"
  shutil.copytree(release[0], old)
  (old / export.STATEMENT_FILE).write_text("{}")
  export.main([f"--model_dir={run_dir}", f"--output_dir={old}",
               "--overwrite"])
  assert json.loads((old / export.STATEMENT_FILE).read_text()) == \
      release[1]["statement"]
  assert sorted(os.listdir(tmp_path)) == ["old_release", "other_run"]


def test_command_line_refusal_exits_2(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run(
      [sys.executable, "-m", "dpjax.export", f"--model_dir={tmp_path / 'no'}",
       f"--output_dir={tmp_path / 'out'}"], capture_output=True, text=True,
      cwd=test_trainer.REPO, env=env, timeout=120)
  assert proc.returncode == 2, proc.stderr
  (line,) = console.own_lines(proc.stderr)
  assert line.startswith("error: ") and "no checkpoint" in line
  assert sorted(os.listdir(tmp_path)) == []


def test_an_adapters_only_release_needs_lora_and_a_base(run_dir, tmp_path,
                                                        capsys):
  """The run is a T5 without adapters: refused, one line, nothing written
  (tests/pretrained/test_peft_release.py releases LoRA adapters)."""
  assert "no LoRA adapters" in _refused(
      capsys, f"--model_dir={run_dir}", f"--output_dir={tmp_path / 'a'}",
      "--adapters_only", "--base_model=t5-tiny")
  assert "--base_model names the base of --adapters_only" in _refused(
      capsys, f"--model_dir={run_dir}", f"--output_dir={tmp_path / 'a'}",
      "--base_model=t5-tiny")
  assert os.listdir(tmp_path) == []
