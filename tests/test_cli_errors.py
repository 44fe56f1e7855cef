"""Every bad input and fault of the commands: one line on stderr, exit 2 for
the user's mistakes and 1 for faults of the system, no traceback, nothing
written. In-process (`main(argv)` under `gin_cli.exit_on_user_error`, as each
command's `__main__` runs it); the checks run before any model is compiled."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest

from dpjax import errors, gin_cli, infer, train, verify
from dpjax.generation import inference
from dpjax.training import run_config
from tests import test_outsider, test_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Short features: the one case that reads the data tokenises it quickly.
SMALL = "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}"


@pytest.fixture(autouse=True)
def _fresh_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _one_line_error(capsys, code: int) -> str:
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  assert "Traceback" not in err
  assert lines and lines[-1].startswith("error: "), err
  # Only the error line of ours (TF/XLA may log lines of their own first).
  assert sum(line.startswith("error: ") for line in lines) == 1, err
  assert code in (1, 2)
  return lines[-1]


def _exit(capsys, fn, errors, code: int = 2) -> str:
  with pytest.raises(SystemExit) as e:
    gin_cli.exit_on_user_error(fn, errors)
  assert e.value.code == code
  return _one_line_error(capsys, code)


def _train(capsys, model_dir, *args, code: int = 2) -> str:
  argv = ["--gin_file=quickstart.gin", f"--gin.MODEL_DIR={model_dir}", *args]
  return _exit(capsys, lambda: train.main(argv), train.user_errors(), code)


def _infer(capsys, *args, code: int = 2) -> str:
  return _exit(capsys, lambda: infer.main(list(args)), infer.user_errors(),
               code)


@pytest.mark.parametrize("arg, message", [
    ("--gin.TARGET_EPSILON=abc",
     "TARGET_EPSILON (train.target_epsilon) must be a positive number or "
     "'inf', got 'abc'"),
    ("--gin.TARGET_EPSILON=0", "TARGET_EPSILON (train.target_epsilon)"),
    ("--gin.DELTA=1.5", "DELTA (train.delta) must be a number strictly "
                        "between 0 and 1"),
    ("--gin.DELTA=1", "got 1"),
    ("--gin.DELTA=0", "got 0"),
    ("--gin.DELTA=-0.1", "got -0.1"),
    ("--gin.DELTA=1/m", "got '1/m'"),
    ("--gin.TRAIN_STEPS=-3",
     "TRAIN_STEPS (train.train_steps) must be a positive integer or None, "
     "got -3"),
    ("--gin.CLIP_NORM=0", "CLIP_NORM (train.clip_norm) must be a positive "
                          "finite number, got 0"),
    ("--gin.CLIP_NORM=-1", "got -1"),
    ("--gin.BATCH_SIZE=0", "BATCH_SIZE (train.batch_size) must be a positive "
                           "integer, got 0"),
    ("--gin.EPOCHS=-1", "EPOCHS (train.epochs)"),
    ("--gin.MICROBATCH_SIZE=0", "MICROBATCH_SIZE (train.microbatch_size)"),
    ("--gin.TRAIN_STEPS=(", "error: gin: in --gin.TRAIN_STEPS=(: unexpected "
                            "end of input"),
    ("--gin.train.no_such=1", "error: gin: in --gin.train.no_such=1: "
                              "Configurable 'train' doesn't have a parameter"),
])
def test_bad_training_settings_exit_2_before_anything_is_written(
    tmp_path, capsys, arg, message):
  model_dir = tmp_path / "never_written"
  assert message in _train(capsys, model_dir, arg)
  assert not model_dir.exists()


@pytest.mark.parametrize("args, message", [
    (["--gin_file=no_such.gin"], "gin file not found: no_such.gin"),
    (["--gin.train.no_such_flag=1"], "no_such_flag"),
    (["--gin.MSMARCO_DIR=/no/such/dir"], "/no/such/dir"),
])
def test_bad_files_and_flags_exit_2_with_a_message(tmp_path, capsys, args,
                                                   message):
  model_dir = tmp_path / "never_written"
  assert message in _train(capsys, model_dir, *args)
  assert not model_dir.exists()


def test_infer_without_a_trained_model_exits_2_and_writes_nothing(
    tmp_path, capsys):
  model_dir = tmp_path / "no_model"
  assert "no checkpoint under" in _infer(capsys, f"--model_dir={model_dir}")
  assert not model_dir.exists()


def test_a_bad_binding_is_named_among_several(tmp_path, capsys):
  line = _train(capsys, tmp_path / "run", "--gin.TRAIN_STEPS=2",
                "--gin_bindings=train.log_period = 1\ntrain.eval_period = )",
                "--gin.BATCH_SIZE=8")
  assert line == ("error: gin: in --gin_bindings='train.log_period = 1\\n"
                  "train.eval_period = )': Unable to parse value (line 2)")


def test_batch_size_above_n_names_both(tmp_path, capsys):
  model_dir = tmp_path / "never_written"
  line = _train(capsys, model_dir, SMALL, "--gin.BATCH_SIZE=3000")
  assert line == ("error: BATCH_SIZE (train.batch_size) = 3000 must be <= "
                  "the number of training examples n = 2998")
  assert not model_dir.exists()


def test_a_plan_over_the_budget_is_refused_in_one_line(tmp_path, capsys):
  """σ = 0.3 for 100 steps of q = 256 / 2998 spends far more than ε = 3:
  refused before anything is written, naming both figures."""
  model_dir = tmp_path / "never_written"
  line = _train(capsys, model_dir, SMALL, "--gin.train.noise_multiplier=0.3")
  assert line.startswith("error: refusing to start: Planned epsilon ")
  assert "exceeds the target 3 " in line
  assert not model_dir.exists()


def test_check_batch_size_empty_split_and_delta_1_over_n():
  with pytest.raises(errors.UsageError, match=r"no examples \(n = 0\)"):
    run_config.check_batch_size(1, 0)
  with pytest.raises(errors.UsageError, match="'1/n' is 1"):
    run_config.check_batch_size(1, 1, "1/n")
  run_config.check_batch_size(2, 2, "1/n")


def test_empty_msmarco_files_name_the_file(tmp_path, capsys):
  data = tmp_path / "msmarco"
  data.mkdir()
  for name in ("collection.tsv", "queries.train.tsv", "qrels.train.tsv",
               "queries.dev.tsv", "qrels.dev.tsv"):
    (data / name).write_text("")
  model_dir = tmp_path / "never_written"
  line = _train(capsys, model_dir, f"--gin.MSMARCO_DIR={data}")
  assert line == (f"error: {data / 'collection.tsv'}: the file is empty "
                  "(expected lines pid<TAB>passage)")
  assert not model_dir.exists()
  (data / "collection.tsv").write_text("0\tsome passage\n")
  line = _train(capsys, model_dir, f"--gin.MSMARCO_DIR={data}")
  assert f"{data / 'queries.train.tsv'}: the file is empty" in line
  assert not model_dir.exists()


def test_model_dir_that_is_a_file_is_refused_untouched(tmp_path, capsys):
  path = tmp_path / "a_file"
  path.write_text("mine")
  line = _train(capsys, path)
  assert line == (f"error: MODEL_DIR (train.model_dir) {path} exists and is "
                  "not a directory")
  assert path.read_text() == "mine"
  line = _train(capsys, path / "run")
  assert f"{path} is not a directory" in line
  assert path.read_text() == "mine"


def test_read_only_model_dir_is_refused_untouched(tmp_path, capsys,
                                                  monkeypatch):
  parent = tmp_path / "read_only"
  parent.mkdir()
  parent.chmod(0o555)
  # root may write anywhere: deny it as a read-only mount would.
  real_access = os.access
  monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(
      p).startswith(str(parent)) and mode & os.W_OK else real_access(
          p, mode, **kw))
  try:
    line = _train(capsys, parent / "run")
    assert line == (f"error: MODEL_DIR (train.model_dir) {parent / 'run'} is "
                    f"not writable: no write permission on {parent}")
    assert os.listdir(parent) == []
  finally:
    parent.chmod(0o755)


@pytest.mark.parametrize("args, message", [
    (["--top_p=2"], "error: --top_p must be in (0, 1]"),
    (["--top_p=0"], "--top_p must be in (0, 1]"),
    (["--temperature=-1"], "error: --temperature must be > 0 (or use "
                           "--greedy), got -1.0"),
    (["--temperature=0"], "--temperature must be > 0"),
    (["--top_k=-1"], "--top_k must be an integer >= 0"),
    (["--batch_size=0"], "error: --batch_size must be a positive integer, "
                         "got 0"),
    (["--limit=0"], "--limit must be a positive integer"),
])
def test_infer_refuses_bad_decoding_flags(tmp_path, capsys, args, message):
  model_dir = tmp_path / "no_model"
  assert message in _infer(capsys, f"--model_dir={model_dir}", *args)
  assert not model_dir.exists()


def test_infer_greedy_needs_no_temperature(tmp_path, capsys):
  line = _infer(capsys, f"--model_dir={tmp_path / 'none'}", "--greedy",
                "--temperature=-1")
  assert "no checkpoint under" in line  # got past the flag checks


def test_generate_synthetic_names_its_gin_binding():
  with pytest.raises(errors.UsageError,
                     match=r"generate_synthetic\.top_p must be in \(0, 1\]"):
    inference.generate_synthetic(model_dir="/nonexistent", top_p=1.5)


@pytest.mark.parametrize("text, message", [
    ("train.batch_size = (\n", "config.gin: unexpected end of input"),
    ("train.batch_size = 3\n%%%\n", "config.gin:2: Unexpected token"),
    ("\x00\xff garbage\n", "'utf-8' codec can't decode"),
    ("import no_such_module_anywhere\n",
     "config.gin:1: No module named 'no_such_module_anywhere'"),
    ("no_such_configurable.x = 1\n",
     "config.gin:1: No configurable matching 'no_such_configurable'"),
])
def test_infer_garbled_config_gin(tmp_path, capsys, text, message):
  (tmp_path / "config.gin").write_bytes(text.encode("latin-1"))
  before = sorted(os.listdir(tmp_path))
  line = _infer(capsys, f"--model_dir={tmp_path}")
  assert line.startswith("error: gin: ") and message in line
  assert sorted(os.listdir(tmp_path)) == before


def test_a_runs_config_gin_from_before_the_packages_still_parses(tmp_path):
  # A run written before the modules moved imports them by their old names.
  gin.clear_config()
  path = tmp_path / "config.gin"
  path.write_text("import dpjax.trainer as dpjax2\nimport tasks\n\n"
                  "train.seed = 7\nlogical_axis_rules.name = 'fsdp'\n")
  gin_cli.configure([], [], run_files=[str(path)])
  assert gin.query_parameter("train.seed") == 7
  assert gin.query_parameter("logical_axis_rules.name") == "fsdp"
  gin.clear_config()
  # A module that exists under no name is still an error.
  user_file = tmp_path / "mine.gin"
  user_file.write_text("import dpjax.not_a_module_ever\n")
  with pytest.raises(errors.UsageError, match="mine.gin:1: No module named"):
    gin_cli.configure([str(user_file)], [])
  gin.clear_config()


def test_unsafe_pytorch_bin_is_a_checkpoint_error(tmp_path, capsys):
  torch = pytest.importorskip("torch")
  from dpjax.pretrained import hf
  import argparse  # any non-tensor object: weights_only refuses its class
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "config.json").write_text("{}")
  torch.save({"w": torch.zeros(2), "args": argparse.Namespace(lr=1)},
             ckpt / "pytorch_model.bin")
  with pytest.raises(hf.CheckpointError) as e:
    hf.open_hf_checkpoint(ckpt)
  assert "weights_only=False" not in str(e.value).split("python -c")[0]
  line = _exit(capsys, lambda: hf.open_hf_checkpoint(ckpt),
               train.user_errors())
  assert line.startswith(f"error: {ckpt / 'pytorch_model.bin'}: refused as "
                         "unsafe: it holds an object of type "
                         "argparse.Namespace")
  assert "arbitrary code" in line and "save_file(" in line
  # The conversion it suggests works (run here, with nothing but what it
  # imports itself), and the directory then loads.
  snippet = line.split("python -c ")[1].split(" (or, sharded")[0]
  exec(snippet.strip('"'), {})
  _, reader = hf.open_hf_checkpoint(ckpt)
  assert reader.keys() == ["w"]


@gin.configurable
def _writes(error):
  raise error


@pytest.mark.parametrize("error, message", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/x"),
     "error: No space left on device: '/data/x'"),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/run"),
     "error: Permission denied: '/ro/run'"),
])
def test_os_faults_exit_2_in_one_line(capsys, error, message):
  # Raised inside a gin configurable: gin appends its call context.
  line = _exit(capsys, lambda: _writes(error), train.user_errors(), code=2)
  assert line == message


def test_user_error_drops_gins_call_context(capsys):
  line = _exit(capsys, lambda: _writes(errors.UsageError("bad value")),
               (errors.UsageError,))
  assert line == "error: bad value"


def test_programming_errors_keep_their_traceback():
  with pytest.raises(KeyError):
    gin_cli.exit_on_user_error(lambda: {}["missing"], train.user_errors())


def test_infer_subprocess_refuses_top_p(tmp_path):
  """The real `__main__` (flags are checked before the data layer loads)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  model_dir = tmp_path / "no_model"
  proc = subprocess.run(
      [sys.executable, "-m", "dpjax.infer", f"--model_dir={model_dir}",
       "--top_p=2"], capture_output=True, text=True, cwd=REPO, env=env,
      timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --top_p")
  assert "Traceback" not in proc.stderr
  assert not model_dir.exists()


# --- A save that fails keeps its cause. --------------------------------------

_FULL_DISK_SIZE = "2m"  # the step-1 checkpoint fits, the step-2 one does not


def _mount_tmpfs(path, size: str) -> bool:
  os.makedirs(path, exist_ok=True)
  return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                         "tmpfs", str(path)], capture_output=True).returncode == 0


# In-process, orbax's thread for the failed save later posts to the event
# loop its manager closed; the process (a command) would have exited.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_full_disk_is_one_line_with_the_os_error_and_the_rerun_resumes(
    tmp_path, capsys):
  disk = tmp_path / "disk"
  if not _mount_tmpfs(disk, _FULL_DISK_SIZE):
    pytest.skip("mounting a tmpfs needs CAP_SYS_ADMIN")
  try:
    model_dir = disk / "run"
    pinned = "train.pinned_secret_seed = 11"
    flags = [f"--gin.{b.replace(' = ', '=', 1)}" for b in
             [*test_outsider.RUN, "TRAIN_STEPS = 2", pinned]]
    line = _train(capsys, model_dir, *flags)
    assert line.startswith("error: saving the checkpoint at step 2 ")
    assert "No space left on device [Errno 28]" in line
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
