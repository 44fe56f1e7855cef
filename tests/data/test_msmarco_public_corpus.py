"""The public pretraining corpus of the MSMARCO-format world
(`tasks/data/msmarco_public/`): reproducible, disjoint from the private
sample (`tasks/data/msmarco_sample/`), well-formed, and encodable by the
sample's SentencePiece model."""
import os
import re

import pytest
import sentencepiece as spm

from dpjax.data.readers import msmarco
from tasks.msmarco_sample import generate
from tests import public_corpora

PUBLIC_DIR = generate.DEFAULT_PUBLIC_DIR
SAMPLE_DIR = msmarco.DEFAULT_SAMPLE_DIR
# The private files with text: the collection (distractors included) and the
# queries of both splits; their second column is the text.
PRIVATE_TEXT_FILES = ("collection.tsv", "queries.train.tsv", "queries.dev.tsv")
SPM_MODEL = os.path.join(SAMPLE_DIR, generate.SPM_SUBDIR,
                         generate.SPM_MODEL_NAME + ".model")


def _words(text):
  """Lower-cased letter runs: the "words" every check below compares."""
  return set(re.findall(r"[a-z]+", text.lower()))


@pytest.fixture(scope="module")
def docs():
  return public_corpora.documents(PUBLIC_DIR)


@pytest.fixture(scope="module")
def public_words(docs):
  return set().union(*(_words(d) for d in docs["train"] + docs["validation"]))


@pytest.fixture(scope="module")
def private_texts():
  texts = []
  for name in PRIVATE_TEXT_FILES:
    with open(os.path.join(SAMPLE_DIR, name), encoding="utf-8") as f:
      texts += [line.rstrip("\n").split("\t", 1)[1] for line in f]
  return texts


@pytest.fixture(scope="module")
def template_words():
  """Every word written in the generator's source (its templates, fillers
  and attribute pools), with its English plural forms (+s, +es, y -> ies),
  less the sample's first names (`generate._FIRST_NAMES`, the sample's
  person-name pool). Invented names are drawn at run time, so they are
  never in the source."""
  with open(generate.__file__, encoding="utf-8") as f:
    words = _words(f.read())
  words |= {w + "s" for w in words} | {w + "es" for w in words}
  words |= {w[:-1] + "ies" for w in words if w.endswith("y")}
  return words - {n.lower() for n in generate._FIRST_NAMES}


def test_committed_corpus_equals_fresh_generation(tmp_path):
  stats = generate.generate_public_corpus(str(tmp_path))
  names = sorted(os.listdir(PUBLIC_DIR))
  assert names == sorted(generate.PUBLIC_FILES + ("README.md",))
  assert sorted(os.listdir(tmp_path)) == names
  for name in names:
    with open(os.path.join(PUBLIC_DIR, name), "rb") as a, open(
        os.path.join(tmp_path, name), "rb") as b:
      assert a.read() == b.read(), f"{name}: rerun --public_corpus"
  assert stats["seed"] == generate.PUBLIC_SEED != generate.SEED
  for split, texts in public_corpora.documents(PUBLIC_DIR).items():
    assert stats[split]["documents"] == len(texts)
    assert stats[split]["words"] == sum(len(t.split()) for t in texts)
    assert stats[split]["passages"] + stats[split]["queries"] == len(texts)


def test_cli_writes_the_same_corpus(tmp_path):
  generate.main(["--public_corpus", f"--output_dir={tmp_path}"])
  for name in generate.PUBLIC_FILES:
    with open(os.path.join(PUBLIC_DIR, name), "rb") as a, open(
        os.path.join(tmp_path, name), "rb") as b:
      assert a.read() == b.read(), name
  # The sample's files are not written by --public_corpus.
  assert not os.path.exists(os.path.join(tmp_path, "collection.tsv"))


def test_format_and_sizes():
  docs = public_corpora.check_format_and_sizes(PUBLIC_DIR)
  train, val = docs["train"], docs["validation"]
  assert len(set(train)) == len(train) and len(set(val)) == len(val)
  # The task's surface text, without its prefix: passages of MIN..MAX_WORDS
  # and short queries, both present.
  passages = [d for d in train if d.endswith(".")]
  queries = [d for d in train if not d.endswith(".")]
  assert len(passages) > 1000 and len(queries) > 1000
  assert all(generate.MIN_WORDS <= len(d.split()) <= generate.MAX_WORDS
             for d in passages)
  assert all(len(d.split()) <= 15 for d in queries)
  assert not any(d.startswith(generate.TASK_INPUT_PREFIX) for d in train + val)


def test_shared_words_are_template_words(public_words, private_texts,
                                         template_words):
  """P = words of the committed private collection.tsv and queries.{train,
  dev}.tsv; Q = words of the committed public corpus; T = template words
  (see the fixture). Every word in both P and Q must be in T: no invented
  name of the sample (entity, town, region, river, mountain, sea, surname)
  occurs as a word in the public corpus, nor any public name in the
  sample."""
  private_words = set().union(*(_words(t) for t in private_texts))
  assert not (private_words & public_words) - template_words
  # Not vacuous: both sides have many names of their own, and the check
  # flags a sample passage slipped into the public corpus.
  assert len(private_words - template_words) > 3000
  assert len(public_words - template_words) > 3000
  assert (private_words & (public_words | _words(private_texts[0]))
          ) - template_words


def test_no_sample_person_name_in_public_corpus(public_words, private_texts):
  """Person names: the sample's first names (`generate._FIRST_NAMES`) and
  every surname that follows one of them in the private files; none occurs
  as a word (any case) in the public corpus, and no public first name
  occurs in the private files."""
  first = "|".join(generate._FIRST_NAMES)
  pattern = re.compile(rf"\b({first}) ([A-Z][a-z]+)\b")
  surnames = {m.group(2).lower() for t in private_texts
              for m in pattern.finditer(t)}
  assert len(surnames) > 200
  person_words = surnames | {n.lower() for n in generate._FIRST_NAMES}
  assert not person_words & public_words
  private_words = set().union(*(_words(t) for t in private_texts))
  public_first = {n.lower() for n in generate._PUBLIC_FIRST_NAMES}
  assert public_first <= public_words  # the public persons' names are used
  assert not public_first & private_words


def test_no_canary_in_public_corpus(tmp_path, docs):
  """The retrieval experiment's canaries (its default insertion into the
  sample) and any 10-digit secret never occur in the public corpus."""
  from dpjax.pipelines.retrieval import canaries  # lazy: imports jax

  inserted = canaries.insert_canaries(SAMPLE_DIR, str(tmp_path / "canaries"))
  assert inserted
  text = "\n".join(docs["train"] + docs["validation"]).lower()
  assert not re.search(r"[0-9]{5,}", text)  # secrets are 10 digits
  for c in inserted:
    assert c.secret not in text and c.query.lower() not in text
    assert c.prefix.lower() not in text


def test_every_document_encodes_without_unk(docs):
  sp = spm.SentencePieceProcessor(model_file=SPM_MODEL)
  assert sp.unk_id() == 2
  all_docs = docs["train"] + docs["validation"]
  ids = sp.encode(all_docs)
  assert not [d for d, x in zip(all_docs, ids) if sp.unk_id() in x]
  assert sp.decode(ids) == all_docs
