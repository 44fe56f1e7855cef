"""The SeqPATE world's public pretraining corpus (`tasks/data/seqpate_public/`,
written by `python -m tasks.seqpate_sample.generate --public_corpus`).

The disjointness tests read the private sample's committed files
(`tasks/data/seqpate_sample/`), not the generator's pools: the private
entities are the words of every customer name (`intent.name` and
`action.name` of `train_data.json` and `dev_data.json`) and every airport
code (`intent.departure_airport` / `intent.return_airport`). Europarl's
sample has no entity fields; there the whole sentences are compared.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import re

import pytest

from dpjax.data.readers import seqpate
from tasks.seqpate_sample import generate
from tests import public_corpora

PUBLIC_DIR = generate.DEFAULT_PUBLIC_DIR
SAMPLE_DIR = os.path.dirname(seqpate.DEFAULT_VOCAB_DIR)
SPLITS = {"train": "train.jsonl", "validation": "validation.jsonl"}
_WORD = re.compile(r"[A-Za-z]+")


@functools.lru_cache(maxsize=None)
def _public() -> dict[str, list[str]]:
  return public_corpora.documents(PUBLIC_DIR)


def _docs(split: str) -> list[str]:
  return _public()[split]


@functools.lru_cache(maxsize=None)
def _private_entities() -> dict[str, frozenset[str]]:
  """{"names": words of the customers' names, "airports": airport codes},
  read from the committed AirDialogue files."""
  names, airports = set(), set()
  for fname in seqpate.AIRDIALOGUE_FILES.values():
    with open(os.path.join(SAMPLE_DIR, "airdialogue", fname),
              encoding="utf-8") as f:
      for line in f:
        record = json.loads(line)
        for field in (record["intent"]["name"], record["action"]["name"]):
          names.update(field.split())
        airports.add(record["intent"]["departure_airport"])
        airports.add(record["intent"]["return_airport"])
  return {"names": frozenset(names), "airports": frozenset(airports)}


def _entity_hits(docs) -> dict[str, list[str]]:
  """Private entities occurring as a word of `docs` (case-sensitive)."""
  entities = _private_entities()
  words = {w for d in docs for w in _WORD.findall(d)}
  return {kind: sorted(words & pool) for kind, pool in entities.items()
          if words & pool}


def test_committed_public_corpus_equals_fresh_generation(tmp_path):
  stats = generate.generate_public_corpus(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(PUBLIC_DIR)) == [
      "README.md", "train.jsonl", "validation.jsonl"]
  for name in os.listdir(tmp_path):
    with open(os.path.join(tmp_path, name), "rb") as fresh, open(
        os.path.join(PUBLIC_DIR, name), "rb") as committed:
      assert fresh.read() == committed.read(), f"{name}: rerun the generator"
  for split, name in SPLITS.items():
    assert stats[split]["documents"] == len(_public()[split])
    assert stats[split]["bytes"] == os.path.getsize(
        os.path.join(PUBLIC_DIR, name))
  assert generate.PUBLIC_SEED not in generate.SEEDS.values()


def test_no_private_name_or_airport_in_public_corpus():
  entities = _private_entities()
  # The comparison is meaningful: the sample has many names and airports,
  # the public corpus has customer names and airport codes of its own.
  assert len(entities["names"]) > 40 and len(entities["airports"]) > 10
  docs = _docs("train") + _docs("validation")
  assert sum("my name is" in d for d in docs) > 100
  assert sum(bool(re.search(r"\bfrom [A-Z]{3} to [A-Z]{3}\b", d))
             for d in docs) > 100
  assert _entity_hits(docs) == {}
  # ... and the check detects a planted private name and airport.
  name = sorted(entities["names"])[0]
  airport = sorted(entities["airports"])[0]
  planted = docs[:3] + [f"I am {name}, I need a flight from {airport} to X."]
  assert _entity_hits(planted) == {"names": [name], "airports": [airport]}


def test_no_private_sentence_except_shared_templates():
  """No public document is a sample Europarl sentence; a public document
  equal to a sample AirDialogue utterance must be one that occurs in the
  dialogues of at least two different sample customers (a template, not
  one customer's sentence)."""
  docs = set(_docs("train") + _docs("validation"))
  europarl = {s.text for s in seqpate.load_europarl()}
  assert not docs & europarl
  users = collections.defaultdict(set)
  for split in seqpate.AIRDIALOGUE_FILES:
    for s in seqpate.load_airdialogue(split):
      users[" ".join(s.text.split())].add(s.user_id)
  shared = docs & set(users)
  assert shared, "the public corpus should speak the sample's templates"
  assert {d for d in shared if len(users[d]) < 2} == set()


def test_format_and_sizes():
  docs = public_corpora.check_format_and_sizes(PUBLIC_DIR)
  # Rendered as the private LM rows: one single-spaced sentence of
  # MIN_WORDS..MAX_WORDS words, no speaker tag, no special token.
  for doc in docs["train"] + docs["validation"]:
    assert doc == " ".join(doc.split())
    assert seqpate.MIN_WORDS <= len(doc.split()) <= seqpate.MAX_WORDS
    assert not re.match(r"(customer|agent)\s*:", doc)
    assert "<|" not in doc and "\n" not in doc
  # Both of the world's styles are there.
  assert sum("rapporteur" in d or "Commission" in d for d in docs["train"]) > 1000
  assert sum("flight" in d or "reservation" in d for d in docs["train"]) > 1000


def test_documents_encode_with_the_sample_bpe():
  tokenizers = pytest.importorskip("tokenizers")
  vocab_dir = seqpate.DEFAULT_VOCAB_DIR
  bpe = tokenizers.ByteLevelBPETokenizer(
      os.path.join(vocab_dir, "vocab.json"),
      os.path.join(vocab_dir, "merges.txt"))
  with open(os.path.join(vocab_dir, "vocab.json"), encoding="utf-8") as f:
    vocab_size = len(json.load(f))
  assert bpe.get_vocab_size() == vocab_size  # the committed vocabulary
  eos = bpe.token_to_id("<|endoftext|>")
  docs = _docs("train") + _docs("validation")
  encodings = bpe.encode_batch(docs)
  for doc, enc in zip(docs, encodings):
    assert enc.ids and all(0 <= i < vocab_size and i != eos for i in enc.ids)
    assert bpe.decode(enc.ids) == doc  # byte-level: lossless, no <unk>
  words = sum(len(d.split()) for d in docs)
  assert 1.0 < sum(len(e.ids) for e in encodings) / words < 2.0
