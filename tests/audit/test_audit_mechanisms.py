"""Audits of honest runs: at ε = 3, ten audits with fresh secrets never
bound ε above it, for DP-SGD (Poisson and shuffled), adaptive clipping and
user-level DP.

Each audit's bound holds with the confidence it is computed at: for a run
whose guarantee is true, P(bound > ε) <= 1 - confidence, even for a
mechanism that leaks all ε allows. At 99.9% and 40 audits the test fails by
chance with probability at most 4% against a tight mechanism, and far less
here: one-run audits of subsampled DP-SGD sit well below ε (these bounds
are about 0.3 to 1.4 at ε = 3; docs/benchmarks.md). Each audit is a short
run (2 DP steps, 2,000 canaries): the claim is the bound's, not the
audit's power, which `test_audit.py` tests with noiseless runs and planted
bugs."""
from __future__ import annotations

import json
import os

import pytest

from dpjax.privacy import secret
from tests.audit.conftest import audit, audit_gin

AUDITS = 10
CONFIDENCE = 0.999
FLAGS = ["--canaries=2000", f"--confidence={CONFIDENCE}"]
SHORT = ["TRAIN_STEPS=2", "TARGET_EPSILON=3.0"]
USERS = ["TRAIN_STEPS=2", "TARGET_EPSILON=3.0", "BATCH_SIZE=24",
         "MICROBATCH_SIZE=128", "train.delta=1e-5",
         "TASK_FEATURE_LENGTHS={'inputs': 1, 'targets': 31}",
         "register_multidogo_tasks.chunk_length=31",
         "train.checkpoint_period=2", "train.log_period=2"]


def _secret_key(line):
  with open(os.path.join(line["run_dir"], secret.SECRET_FILENAME)) as f:
    return json.load(f)["key"]


@pytest.mark.parametrize("mechanism, run", [
    ("dpsgd", lambda out, data: audit(out, data, *SHORT, flags=FLAGS)),
    ("shuffled", lambda out, data: audit(
        out, data, *SHORT, "train.sampling_method='shuffle'", flags=FLAGS)),
    ("adaptive clipping", lambda out, data: audit(
        out, data, *SHORT, "train.clip_norm='adaptive'", flags=FLAGS)),
    ("user-level", lambda out, data: audit_gin(
        out, "dialog_sample_user_level.gin", *USERS, flags=FLAGS)),
])
def test_ten_audits_at_eps_3_stay_at_or_below_it(mechanism, run, data_dir,
                                                 tmp_path):
  lines = [run(tmp_path / f"audit{i}", data_dir) for i in range(AUDITS)]
  assert len({_secret_key(line) for line in lines}) == AUDITS  # fresh
  for line in lines:
    assert line["epsilon"] == pytest.approx(3.0, abs=0.01)
    assert line["confidence"] == CONFIDENCE
    assert 0 <= line["epsilon_lower_bound"] <= line["epsilon"], (mechanism,
                                                                 line)
