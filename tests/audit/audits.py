"""Audits for the tests: `python -m dpjax.audit` in-process, the small
train split's runs (`audit`, the split from tests/audit/conftest.py) and
any gin run's (`audit_gin`), and the claim every honest audit must meet
(`assert_honest`)."""
from __future__ import annotations

import gin
import pytest

from dpjax.audit import __main__ as audit_cli
from dpjax.privacy import secret

# The quickstart's tiny T5 on short rows, half the small split per step.
RUN = ["INITIAL_CHECKPOINT_PATH=None", "T5Config.vocab_size=2000",
       "TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}", "BATCH_SIZE=32",
       "MICROBATCH_SIZE=64", "TRAIN_STEPS=10", "train.delta=1e-5",
       "train.eval_period=0", "train.log_period=10",
       "train.checkpoint_period=10"]
CANARIES = 10_000
# Honest audits (`assert_honest`): per mechanism, `AUDITS` short runs with
# fresh secrets, each bound at 99.99%.
AUDITS = 10
CONFIDENCE = 0.9999
FLAGS = ["--canaries=2000", f"--confidence={CONFIDENCE}"]
SHORT = ["TRAIN_STEPS=2", "TARGET_EPSILON=3.0"]
# A T5 run's honest audits on a one-layer model and short rows: the audit
# reads the clipped sum, which neither changes (each audit traces afresh).
SMALL_T5 = ["T5Config.num_encoder_layers=1", "T5Config.num_decoder_layers=1",
            "TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}"]


def audit(output_dir, data_dir, *bindings, flags=()) -> dict:
  """`python -m dpjax.audit` in-process on the small split."""
  return audit_gin(output_dir, "quickstart.gin", *RUN,
                   f"register_msmarco_query_generation.data_dir='{data_dir}'",
                   *bindings, flags=flags)


def audit_gin(output_dir, gin_file, *bindings, flags=()) -> dict:
  """`python -m dpjax.audit --gin_file=gin_file` in-process."""
  gin.clear_config()
  try:
    return audit_cli.main([
        f"--gin_file={gin_file}", *(f"--gin.{b}" for b in bindings),
        f"--output_dir={output_dir}", *(flags or [f"--canaries={CANARIES}"])])
  finally:
    gin.clear_config()


def honest_audits(output_dir, gin_file, *bindings) -> list[dict]:
  """`AUDITS` audits at ε = 3 of the run `gin_file` and `bindings`
  describe, each a fresh run with its own secret (2,000 canaries, the
  bounds at `CONFIDENCE`): their JSON lines. Without their plots (0.4 s
  each; `test_audit.py` checks the plot)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(audit_cli, "_plot", lambda *args: None)
    return [audit_gin(output_dir / f"audit{i}", gin_file, *bindings,
                      "TARGET_EPSILON=3.0", flags=FLAGS)
            for i in range(AUDITS)]


def assert_honest(lines, mechanism: str) -> None:
  """Audits (their JSON `lines`) of runs at ε = 3, each with its own
  secret, none bounding ε above 3.

  Each bound holds with the confidence it is computed at: for a run whose
  guarantee is true, P(bound > ε) <= 1 - confidence, even for a mechanism
  that leaks all ε allows. At 99.99% the suite's 41 honest audits (10 per
  mechanism, one input audit) fail by chance with probability at most
  0.41% against tight mechanisms (a union bound), and far less here:
  one-run audits of subsampled DP-SGD sit well below ε (docs/benchmarks.md).
  They are short runs (2,000 canaries): the claim is the bound's, not the
  audit's power, which `test_audit.py` tests with a noiseless run and
  planted bugs."""
  secrets = {secret.RunSecret.load(line["run_dir"]).key for line in lines}
  assert len(secrets) == len(lines)  # fresh secrets
  for line in lines:
    assert line["epsilon"] == pytest.approx(3.0, abs=0.01)
    assert line["confidence"] == CONFIDENCE
    assert 0 <= line["epsilon_lower_bound"] <= line["epsilon"], (mechanism,
                                                                 line)
