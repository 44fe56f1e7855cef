"""Pretraining corpora in JSON Lines: one document per line, `{"text": ...}`.

The layout of C4's and The Pile's JSON releases and of Hugging Face text
datasets: a corpus directory holds `train.jsonl` and `validation.jsonl`;
other fields of a record (a URL, a timestamp) are ignored. The embedded
public corpora (`tasks/data/<world>_public/`, made by each sample generator
with `--public_corpus`) are in this format, and so is any corpus a user
brings.
"""
from __future__ import annotations

import json
import os

from dpjax.data.readers import malformed

SPLITS = ("train", "validation")


def split_path(corpus_dir: str, split: str) -> str:
  """The JSON Lines file of `split` in `corpus_dir`; ValueError if unknown."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; a corpus has {SPLITS}")
  return os.path.join(corpus_dir, f"{split}.jsonl")


def write_documents(path: str, documents) -> None:
  """Writes `documents` to `path`, one `{"text": ...}` per line (UTF-8,
  `\n` line ends, non-ASCII kept as is): what `read_documents` reads."""
  with open(path, "w", encoding="utf-8", newline="\n") as f:
    for text in documents:
      f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def read_documents(path: str, on_malformed: str = "fail") -> list[str]:
  """The documents of one JSON Lines file, in file order.

  A line that is not a JSON object with a non-empty string `text` is
  malformed (`malformed.MalformedPolicy`: "fail" raises, "skip" drops it).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"corpus file not found: {path!r}")
  policy = malformed.MalformedPolicy(on_malformed, f"documents in {path}")
  documents = []
  for lineno, line in malformed.decoded_lines(path, policy):
    try:
      record = malformed.json_object(line)
    except ValueError as e:
      policy(path, lineno, str(e))
      continue
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
      policy(path, lineno, 'expected a non-empty string "text"')
      continue
    documents.append(text)
  policy.report()
  return documents
