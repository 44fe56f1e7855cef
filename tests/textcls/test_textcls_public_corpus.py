"""The textcls public pretraining corpus (tasks/data/textcls_public/, written
by `tasks.textcls_sample.generate.generate_public_corpus`): reproducible,
disjoint in entities from the private sample (tasks/data/textcls_sample/),
well-formed, and rendered / encodable like the task's text."""
import dataclasses
import os
import re

import pytest
import tokenizers

from dpjax.data.readers import textcls
from tasks.textcls_sample import generate
from tests import public_corpora

PUBLIC_DIR = generate.DEFAULT_PUBLIC_DIR
SPLITS = ("train", "validation")
_ARTICLE = re.compile(r"^(the|a) ", re.IGNORECASE)


def _words(text: str) -> list[str]:
  """Lower-cased alphanumeric runs ("Nebulink's" -> nebulink, s)."""
  return re.findall(r"[a-z0-9]+", text.lower())


def _read_split(directory, split: str) -> list[str]:
  public_corpora.check_lines(directory, split)
  return public_corpora.documents(directory)[split]


@pytest.fixture(scope="module")
def public():
  return {split: _read_split(PUBLIC_DIR, split) for split in SPLITS}


@pytest.fixture(scope="module")
def private_texts():
  """The texts of the committed private sample files, as the task reads them."""
  return [e.text for d in textcls.DATASETS for s in textcls.SPLITS
          for e in textcls.load_examples(d, s)]


def _entity_words(private_texts: list[str]) -> set[str]:
  """Words that occur in the private texts only inside sample entities.

  A sample entity is an entry of one of the generator's sample pools
  (`generate.SAMPLE_POOLS`: films, directors, countries, cities, people,
  teams, companies, tech firms) without a leading article, matched
  case-insensitively at word boundaries (longest first, so "ITHMAR BAY" is
  one entity). The entity words are the words of the matched entries that no
  longer occur anywhere in the private texts once every entity occurrence is
  cut out: "velport", "hartwell", "mariners", "kings" are entity words;
  "the", "long" (also in "drags on far too long") are template words.
  """
  entries = sorted({_ARTICLE.sub("", e) for f in dataclasses.fields(generate.SAMPLE_POOLS)
                    for e in getattr(generate.SAMPLE_POOLS, f.name)}, key=len, reverse=True)
  pattern = re.compile(r"\b(?:" + "|".join(re.escape(e) for e in entries) + r")(?![\w])",
                       re.IGNORECASE)
  matched, outside = set(), set()
  for text in private_texts:
    matched.update(w for m in pattern.finditer(text) for w in _words(m.group()))
    outside.update(_words(pattern.sub(" | ", text)))
  return matched - outside


# (a) reproducibility -------------------------------------------------------


def test_committed_corpus_equals_a_fresh_generation(tmp_path):
  stats = generate.generate_public_corpus(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(PUBLIC_DIR)) == [
      "README.md", "train.jsonl", "validation.jsonl"]
  for name in os.listdir(PUBLIC_DIR):
    with open(os.path.join(PUBLIC_DIR, name), "rb") as f, open(tmp_path / name, "rb") as g:
      assert f.read() == g.read(), f"{name} differs from a fresh generation"
  for split in SPLITS:
    texts = _read_split(tmp_path, split)
    assert stats[split] == {"documents": len(texts),
                            "words": sum(len(t.split()) for t in texts),
                            "characters": sum(len(t) for t in texts)}
    assert f"| documents | {stats['train']['documents']} |" in (tmp_path / "README.md").read_text()


def test_cli_flag_writes_the_public_corpus(tmp_path):
  generate.main(["--public_corpus", f"--output_dir={tmp_path}"])
  assert sorted(os.listdir(tmp_path)) == ["README.md", "train.jsonl", "validation.jsonl"]
  with open(os.path.join(PUBLIC_DIR, "validation.jsonl"), "rb") as f:
    assert (tmp_path / "validation.jsonl").read_bytes() == f.read()


def test_another_seed_gives_another_corpus(tmp_path):
  generate.generate_public_corpus(str(tmp_path), seed=generate.PUBLIC_SEED + 1)
  assert _read_split(tmp_path, "validation") != _read_split(PUBLIC_DIR, "validation")
  assert generate.PUBLIC_SEED not in generate.SEEDS.values()


# (b) disjointness ----------------------------------------------------------


def test_no_private_entity_word_occurs_in_the_public_corpus(public, private_texts):
  """Compared: the entity words of the committed private files (see
  `_entity_words`) against every word (lower-cased alphanumeric run) of the
  public documents, both splits."""
  entity_words = _entity_words(private_texts)
  assert len(entity_words) > 80
  assert {"velport", "castrana", "hartwell", "nebulink", "mariners", "kings",
          "northbound", "copperhead", "pellham", "corp"} <= entity_words
  assert not {"the", "a", "of", "and", "long", "reuters", "monday"} & entity_words
  public_words = {w for split in SPLITS for doc in public[split] for w in _words(doc)}
  shared = sorted(entity_words & public_words)
  assert not shared, f"private entity words in the public corpus: {shared}"
  # The check can fail: it flags the private texts themselves.
  assert entity_words & {w for t in private_texts for w in _words(t)} == entity_words


def test_capitalised_private_words_are_entities_or_template_words(public, private_texts):
  """Every capitalised word of the private texts (AG News: names, places,
  companies, template words) is either a private entity word, and then absent
  from the public corpus (previous test), or a template word that the public
  corpus also uses ("Reuters", "Monday", "UN", "Mars", ...): the sample
  pools leave no capitalised private name uncounted. The public corpus has
  its own names (words absent from the private texts)."""
  entity_words = _entity_words(private_texts)
  public_words = {w for split in SPLITS for doc in public[split] for w in _words(doc)}
  capitalised = {w.lower() for t in private_texts for w in re.findall(r"\b[A-Z][A-Za-z]*", t)}
  unaccounted = sorted(capitalised - entity_words - public_words)
  assert not unaccounted, f"capitalised private words in no sample pool: {unaccounted}"
  private_words = {w for t in private_texts for w in _words(t)}
  public_names = {w.lower() for doc in public["train"]
                  for w in re.findall(r"\b[A-Z][A-Za-z]*", doc)} - private_words
  assert {"sarvenia", "varnport", "cipherworks", "thornbury", "harriers"} <= public_names


def test_no_public_document_is_a_private_text(public, private_texts):
  private = set(private_texts)
  for split in SPLITS:
    assert not [d for d in public[split] if d in private]


def test_pool_check_rejects_shared_words():
  generate.check_public_pools()  # the committed pools pass
  leaky = dataclasses.replace(generate.PUBLIC_POOLS,
                              people=generate.PUBLIC_POOLS.people + ("Nils Hartwell",))
  with pytest.raises(ValueError, match="hartwell"):
    generate.check_public_pools(leaky)


# (c) format ----------------------------------------------------------------


def test_format_splits_and_sizes(public):
  assert public_corpora.check_format_and_sizes(PUBLIC_DIR) == public
  train, validation = public["train"], public["validation"]
  assert len(set(train)) == len(train) and len(set(validation)) == len(validation)
  assert 0.04 <= len(validation) / (len(train) + len(validation)) <= 0.06


def test_both_styles_and_no_labels(public):
  docs = public["train"] + public["validation"]
  # SST-2 style: lower-case tokenized sentences; AG News style: capitalised
  # title + description. Both are present in similar numbers.
  sst2 = [d for d in docs if d == d.lower()]
  assert 0.4 <= len(sst2) / len(docs) <= 0.7
  assert any(" 's " in d for d in sst2) and any(d.endswith(" .") for d in sst2)
  assert any("#39;s" in d for d in docs) and any("(Reuters)" in d for d in docs)
  for word in ("negative", "positive", "world", "sports", "business", "sci/tech", "label"):
    assert not [d for d in docs if d.split()[0].lower() == word]
  assert not [d for d in docs if "<|" in d or "|>" in d or "\t" in d]


def test_rendering_is_the_task_text():
  """`generate.render` of the sample's items is exactly what the task reads
  from the committed sample files."""
  for dataset in textcls.DATASETS:
    for split in textcls.SPLITS:
      rendered = [generate.render(dataset, item)
                  for _, item in generate.sample_items(dataset, split)]
      assert rendered == [e.text for e in textcls.load_examples(dataset, split)]


# (d) tokenizer -------------------------------------------------------------


def test_documents_encode_with_the_sample_bpe(public, private_texts):
  """Byte-level BPE: nothing is unknown, so check that every document
  round-trips through the committed vocabulary without extra tokens, and
  that public text needs at most 1.5x the private tokens per word."""
  tok = tokenizers.ByteLevelBPETokenizer(textcls.DEFAULT_BPE_VOCAB_PATH,
                                         textcls.DEFAULT_BPE_MERGES_PATH)
  size = tok.get_vocab_size()
  docs = public["train"] + public["validation"]
  encodings = tok.encode_batch(docs)
  for doc, enc in zip(docs, encodings):
    assert enc.ids and max(enc.ids) < size
    assert tok.decode(enc.ids) == doc
  public_rate = sum(len(e.ids) for e in encodings) / sum(len(d.split()) for d in docs)
  private_rate = (sum(len(e.ids) for e in tok.encode_batch(private_texts))
                  / sum(len(t.split()) for t in private_texts))
  assert public_rate <= 1.5 * private_rate, (public_rate, private_rate)
