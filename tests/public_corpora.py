"""The format every embedded public corpus keeps (tasks/data/<world>_public,
made by `python -m tasks.<world>_sample.generate --public_corpus`, read by
`dpjax.data.readers.text_corpus`): the part of each world's corpus test that is
the same for all of them."""
import json
import os

from dpjax.data.readers import text_corpus


def documents(corpus_dir) -> dict[str, list[str]]:
  """{split: its documents}, through the reader the pretraining task uses."""
  return {split: text_corpus.read_documents(
      text_corpus.split_path(str(corpus_dir), split))
          for split in text_corpus.SPLITS}


def check_lines(corpus_dir, split: str) -> None:
  """Every line of the split's file is exactly `json.dumps({"text": doc},
  ensure_ascii=False) + "\\n"` with a non-empty `doc` (so no blank line, no
  other field, a final newline)."""
  path = text_corpus.split_path(str(corpus_dir), split)
  with open(path, encoding="utf-8", newline="") as f:
    for line in f:
      record = json.loads(line)
      assert list(record) == ["text"] and isinstance(record["text"], str)
      assert record["text"].strip(), f"{path}: empty document"
      assert line == json.dumps(record, ensure_ascii=False) + "\n", line


def check_format_and_sizes(corpus_dir) -> dict[str, list[str]]:
  """Asserts the shared contract and returns `documents(corpus_dir)`:
  `check_lines` on both splits; no document in both; validation at least 50
  documents and 3-8% of all; train.jsonl between 0.6 and 1.5 MB."""
  for split in text_corpus.SPLITS:
    check_lines(corpus_dir, split)
  docs = documents(corpus_dir)
  train, validation = docs["train"], docs["validation"]
  assert not set(train) & set(validation)
  assert len(validation) >= 50
  assert 0.03 <= len(validation) / (len(train) + len(validation)) <= 0.08
  size = os.path.getsize(text_corpus.split_path(str(corpus_dir), "train"))
  assert 600_000 <= size <= 1_500_000, size
  return docs
