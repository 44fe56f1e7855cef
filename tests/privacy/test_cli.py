"""`python -m dpjax.privacy` and the no-TensorFlow rule, via subprocess."""

import json
import math
import os
import subprocess
import sys

import pytest

from dpjax.privacy import __main__ as cli
from dpjax.privacy import accounting
from tests import console

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def run(*args):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_calibrate_prints_library_result():
  out = run("-m", "dpjax.privacy", "calibrate", "--epsilon", "2",
            "--delta", "1e-5", "--sampling_rate", "0.02", "--steps", "200",
            "--accountant", "pld")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  sigma = accounting.dpsgd_noise_multiplier(2.0, 1e-5, 0.02, 200, "pld")
  assert result["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
  assert result["epsilon"] == pytest.approx(
      accounting.dpsgd_epsilon(sigma, 0.02, 200, 1e-5, "pld"))
  assert result["epsilon"] <= 2.0
  assert result["sampling_rate"] == 0.02 and result["steps"] == 200


def test_epsilon_from_dataset_batch_epochs():
  out = run("-m", "dpjax.privacy", "epsilon", "--noise_multiplier", "1.1",
            "--delta", "1e-5", "--dataset_size", "1000", "--batch_size", "30",
            "--epochs", "2")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  steps = math.ceil(2 * 1000 / 30)
  assert result["steps"] == steps and result["sampling_rate"] == 30 / 1000
  assert result["epsilon"] == pytest.approx(
      accounting.dpsgd_epsilon(1.1, 0.03, steps, 1e-5))


BAD_ARGS = [
    ["calibrate", "--epsilon", "0", "--delta", "1e-5", "--sampling_rate",
     "0.1", "--steps", "10"],
    ["calibrate", "--epsilon", "1", "--delta", "1", "--sampling_rate", "0.1",
     "--steps", "10"],
    ["epsilon", "--noise_multiplier", "1", "--delta", "1e-5",
     "--sampling_rate", "1.5", "--steps", "10"],
    ["epsilon", "--noise_multiplier", "1", "--delta", "1e-5",
     "--sampling_rate", "0.1", "--steps", "0"],
    ["epsilon", "--noise_multiplier", "1", "--delta", "1e-5"],
    ["calibrate", "--delta", "1e-5", "--sampling_rate", "0.1", "--steps", "1"],
    ["calibrate", "--epsilon", "1", "--delta", "1e-5", "--sampling_rate",
     "0.1", "--steps", "10", "--batch_size", "3"],
]


@pytest.mark.parametrize("args", BAD_ARGS)
def test_bad_input_exits_2_with_one_line(args, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(args)
  assert info.value.code == 2
  out = capsys.readouterr()
  assert out.out == ""
  assert len(out.err.strip().splitlines()) == 1
  assert "error" in out.err


@pytest.mark.parametrize("args", [BAD_ARGS[0], BAD_ARGS[4]])
def test_bad_input_exit_status_of_the_module(args):
  out = run("-m", "dpjax.privacy", *args)
  assert out.returncode == 2
  assert out.stdout == ""
  assert len(console.own_lines(out.stderr)) == 1, out.stderr


def test_privacy_package_does_not_import_tensorflow():
  code = ("import sys, dpjax.privacy, dpjax.privacy.__main__; "
          "bad = [m for m in sys.modules if m.split('.')[0] in "
          "('tensorflow', 'seqio', 'tensorflow_datasets', 'tensorflow_text')]; "
          "assert not bad, bad")
  out = run("-c", code)
  assert out.returncode == 0, out.stderr
