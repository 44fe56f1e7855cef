"""The audit tests' runs: the quickstart's tiny T5 on a small train split."""
from __future__ import annotations

import os

import gin
import pytest

from dpjax.audit import __main__ as audit_cli
from dpjax.data.readers import msmarco

EXAMPLES = 64  # a small train split: a high sampling rate at a small batch
# The quickstart's tiny T5 on short rows, half the split per step.
RUN = ["INITIAL_CHECKPOINT_PATH=None", "T5Config.vocab_size=2000",
       "TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}", "BATCH_SIZE=32",
       "MICROBATCH_SIZE=64", "TRAIN_STEPS=10", "train.delta=1e-5",
       "train.eval_period=0", "train.log_period=10",
       "train.checkpoint_period=10"]
CANARIES = 10_000


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """The embedded MS MARCO sample with its first `EXAMPLES` train qrels."""
  out = tmp_path_factory.mktemp("msmarco64")
  sample = msmarco.DEFAULT_SAMPLE_DIR
  for name in ("collection.tsv", "queries.train.tsv", "queries.dev.tsv",
               "qrels.dev.tsv"):
    os.symlink(os.path.join(sample, name), out / name)
  with open(os.path.join(sample, "qrels.train.tsv")) as f:
    head = [next(f) for _ in range(EXAMPLES)]
  (out / "qrels.train.tsv").write_text("".join(head))
  return str(out)


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
