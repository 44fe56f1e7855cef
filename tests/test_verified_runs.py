"""A release never states a false ε: every command that reads a run's ε
refuses a run whose recorded state was edited (`dpjax.verify`), writing
nothing; a save that fails keeps its cause in one line.

Each tamper is tried twice: as written by anything without the run's secret
(the checkpoint meta's MAC refuses it), and signed again with the secret (the
consistency checks refuse it: what a MAC cannot catch from a slip in dpjax
itself)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest

from dpjax import checkpoints, export, gin_cli, infer, train, verify
from dpjax.privacy import accounting
from tests import test_outsider, test_trainer

META = os.path.join("checkpoints", "2", "meta", "metadata")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """Two DP steps (ε target 1.0), a checkpoint after each, OS-entropy secret."""
  d = tmp_path_factory.mktemp("verified") / "run"
  test_outsider.run(d, "TRAIN_STEPS = 2")
  return d


def _events_of(ledger: dict, steps: int, scale: float = 1.0) -> list[dict]:
  """The events `steps` Poisson DP steps at σ·scale record."""
  sigma = ledger["noise_multiplier"] * scale
  return [accounting.PoissonGaussian(ledger["sampling"]["sampling_rate"],
                                     (sigma,), steps).to_json()]


def no_events(meta):
  meta["ledger"]["events"] = []


def half_the_steps(meta):
  meta["ledger"]["steps"] = 1
  meta["ledger"]["events"] = _events_of(meta["ledger"], 1)


def steps_and_data_position(meta):
  half_the_steps(meta)
  meta["data_position"].update(dp_steps=1, public_steps=1)


def doubled_sigma(meta):
  """σ doubled consistently in the ledger, its events and the plan: before,
  training resumed at 2σ and reported ε 0.74 of 3.0 for a true 2.66."""
  meta["ledger"]["events"] = _events_of(meta["ledger"], 2, scale=2.0)
  meta["ledger"]["noise_multiplier"] *= 2
  meta["plan"]["noise_multiplier"] *= 2


TAMPERS = {  # tamper -> what the consistency checks say once it is re-signed
    no_events: "its events are []",
    half_the_steps: "the ledger's DP steps 1, the data position's 2",
    steps_and_data_position: "the ledger's DP steps 1, the data position's 1, "
                             "the optimizer's noise counter 2",
    doubled_sigma: "is not what calibration gives",
}


def _tampered(run_dir, tmp_path, tamper, *, sign: bool):
  d = tmp_path / "run"
  shutil.copytree(run_dir, d)
  meta = json.loads((d / META).read_text())
  tamper(meta)
  if sign:  # by someone holding the secret: a slip the MAC cannot catch
    meta = checkpoints.signed(meta, verify.meta_key(str(d)))
  (d / META).write_text(json.dumps(meta))
  return d


def _flipped_byte(run_dir, tmp_path):
  """One digit of the ledger changed in place: still JSON, still readable."""
  d = tmp_path / "run"
  shutil.copytree(run_dir, d)
  text = (d / META).read_bytes()
  at = text.index(b'"noise_multiplier": ') + len(b'"noise_multiplier": ') + 2
  assert text[at:at + 1].isdigit()
  (d / META).write_bytes(text[:at] + bytes([48 + (text[at] - 47) % 10])
                         + text[at + 1:])
  return d


def _files(d) -> dict:
  return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*")
          if p.is_file()}


def _refused_by_every_command(d, tmp_path, capsys) -> list[str]:
  """train, export and infer on `d`: each exits 2 with one `error:` line and
  writes nothing (the run directory byte for byte, no output directory)."""
  before = _files(d)
  lines = []
  commands = (
      (lambda: test_outsider.run(d, "TRAIN_STEPS = 2"), train.user_errors()),
      (lambda: export.main([f"--model_dir={d}",
                            f"--output_dir={tmp_path / 'release'}"]),
       (gin_cli.UsageError,)),
      (lambda: infer.main([f"--model_dir={d}",
                           f"--output_dir={tmp_path / 'synthetic'}"]),
       infer.user_errors()))
  for command, errors in commands:
    gin.clear_config()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
      gin_cli.exit_on_user_error(command, errors)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    lines.append(err.strip())
  assert _files(d) == before
  assert sorted(os.listdir(tmp_path)) == ["run"]
  return lines


@pytest.mark.parametrize("tamper", list(TAMPERS), ids=lambda t: t.__name__)
def test_an_edit_without_the_secret_is_refused_by_every_command(
    run_dir, tmp_path, capsys, tamper):
  d = _tampered(run_dir, tmp_path, tamper, sign=False)
  for line in _refused_by_every_command(d, tmp_path, capsys):
    assert "its MAC does not verify under the run's secret" in line


def test_a_flipped_byte_in_the_meta_is_refused_by_every_command(
    run_dir, tmp_path, capsys):
  d = _flipped_byte(run_dir, tmp_path)
  for line in _refused_by_every_command(d, tmp_path, capsys):
    assert "checkpoint 2's meta" in line and "MAC does not verify" in line


@pytest.mark.parametrize("tamper", list(TAMPERS), ids=lambda t: t.__name__)
def test_a_signed_edit_is_refused_by_the_consistency_checks(
    run_dir, tmp_path, capsys, tamper):
  d = _tampered(run_dir, tmp_path, tamper, sign=True)
  for line in _refused_by_every_command(d, tmp_path, capsys):
    assert "checkpoint 2 does not account for its releases" in line
    assert TAMPERS[tamper] in line


def test_doubled_sigma_would_have_understated_epsilon(run_dir):
  """What the refusal prevents, by dp-accounting directly: the edited
  ledger's ε is far below the run's."""
  meta = json.loads((run_dir / META).read_text())
  true = verify.run_ledger(str(run_dir))
  doubled_sigma(meta)
  edited = accounting.epsilon(
      [accounting.event_from_json(e) for e in meta["ledger"]["events"]],
      true.delta, true.accountant)
  assert edited < 0.5 * true.epsilon_spent()


def test_an_untampered_run_passes_and_a_missing_secret_is_refused(
    run_dir, tmp_path):
  step, meta = verify.run_meta(str(run_dir))
  assert step == 2 and meta.ledger["steps"] == 2
  d = tmp_path / "run"
  shutil.copytree(run_dir, d)
  (d / "secret_key.json").unlink()
  with pytest.raises(verify.UnverifiedRunError,
                     match="secret_key.json is missing: the run's checkpoints "
                           "cannot be authenticated"):
    verify.run_ledger(str(d))


# --- A save that fails keeps its cause. --------------------------------------

_FULL_DISK_SIZE = "2m"  # the step-1 checkpoint fits, the step-2 one does not


def _mount_tmpfs(path, size: str) -> bool:
  os.makedirs(path, exist_ok=True)
  return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                         "tmpfs", str(path)], capture_output=True).returncode == 0


def test_a_full_disk_is_one_line_with_the_os_error_and_the_rerun_resumes(
    tmp_path):
  disk = tmp_path / "disk"
  if not _mount_tmpfs(disk, _FULL_DISK_SIZE):
    pytest.skip("mounting a tmpfs needs CAP_SYS_ADMIN")
  try:
    model_dir = disk / "run"
    pinned = "train.pinned_secret_seed = 11"
    flags = [f"--gin.{b.replace(' = ', '=', 1)}" for b in
             [*test_outsider.RUN, "TRAIN_STEPS = 2", pinned]]
    proc = subprocess.run(
        [sys.executable, "-m", "dpjax.train", "--gin_file=quickstart.gin",
         f"--gin.MODEL_DIR='{model_dir}'", *flags], capture_output=True,
        text=True, cwd=test_trainer.REPO, timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = [l for l in proc.stderr.splitlines()
            if l.startswith(("error", "Traceback", "ERROR", "RuntimeError"))]
    assert ours == [proc.stderr.splitlines()[-1]], proc.stderr[-3000:]
    assert ours[0].startswith("error: saving the checkpoint at step 2 ")
    assert "No space left on device [Errno 28]" in ours[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert os.listdir(model_dir / "checkpoints") == ["1"]

    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    test_outsider.run(model_dir, "TRAIN_STEPS = 2", pinned)
    test_outsider.run(tmp_path / "reference", "TRAIN_STEPS = 2", pinned)
    assert (verify.run_ledger(str(model_dir)).to_json()
            == verify.run_ledger(str(tmp_path / "reference")).to_json())
    jax.tree.map(np.testing.assert_array_equal,
                 test_trainer.restored_params(model_dir),
                 test_trainer.restored_params(tmp_path / "reference"))
  finally:
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)
