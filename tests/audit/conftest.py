"""The audit tests' small train split: the quickstart's tiny T5 then samples
half of it per step at a small batch."""
from __future__ import annotations

import os

import pytest

from dpjax.data.readers import msmarco

EXAMPLES = 64  # a high sampling rate at a small batch


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
