"""The public pretraining corpus of the semantic-parsing world
(`tasks/data/semparse_public`, `generate.generate_public_corpus`).

Disjointness is checked against the committed private files themselves
(`tasks/data/{smcalflow,treedst}_sample/*.dataflow_dialogues.jsonl`, every
turn, skipped ones included), not against the generator's entity pools:

* entity literals: every string literal of a private program, except the
  `Path.apply "..."` paths (program structure), is a named entity (person,
  town, venue, room, hotel or attraction name, event subject, message body,
  reminder content, attraction category); none may occur, case-insensitively
  and as whole words, anywhere in a public document;
* names: the capitalised words (`[A-Z][a-z]+`) of those literals and of the
  private utterances after their first word (which the generator may
  capitalise), minus the words that are components of a private program's
  symbols (function and constructor names split at "."; this removes
  exactly the day and month names and `Hotel`, which are the programs'
  language), must not occur as a word in any public document; nor in lower
  case, unless the private sample itself uses the lower-case word (a common
  noun of the templates, like "room" of "reserve a room at" next to "the
  Lantern Room").

Tokenizers: the committed `semparse_vocab` files, through the `tokenizers`
and `sentencepiece` packages (no TensorFlow).
"""
import collections
import json
import os
import re

import pytest
import sentencepiece as spm
from tokenizers import ByteLevelBPETokenizer

from dpjax.data.readers import semparse
from dpjax.data.text import lispress
from tasks import semparse as semparse_tasks
from tasks.semparse_sample import generate
from tests import public_corpora

PUBLIC = generate.DEFAULT_PUBLIC_DIR
FILES = ("train.jsonl", "validation.jsonl", "README.md")
PRIVATE_FILES = [os.path.join(semparse.DEFAULT_DATA_DIRS[d], f)
                 for d in semparse.DATASETS for f in semparse.SPLIT_FILES.values()]
_LITERAL = re.compile(r'(Path\.apply\s+)?("(?:[^"\\]|\\.)*")')
_UTTERANCE = "\nutterance:"


def _read(name):
  with open(os.path.join(PUBLIC, name), encoding="utf-8") as f:
    return f.read()


@pytest.fixture(scope="module")
def docs():
  return public_corpora.documents(PUBLIC)


@pytest.fixture(scope="module")
def private():
  """(entity literals, names, utterances, programs) of every private turn;
  names in the cases they are checked in (see the module docstring)."""
  literals, utterances, programs, symbols = set(), [], [], set()
  for path in PRIVATE_FILES:
    with open(path, encoding="utf-8") as f:
      for line in f:
        for turn in json.loads(line)["turns"]:
          program = turn["lispress"]
          programs.append(program)
          utterances.append(turn["user_utterance"]["original_text"])
          literals.update(json.loads(m.group(2)) for m in _LITERAL.finditer(program)
                          if not m.group(1))
          for sym in re.findall(r'[^\s()"^]+', _LITERAL.sub(" ", program)):
            symbols.update(sym.split("."))
  caps, lower = set(), set()
  for text in sorted(literals) + [" ".join(u.split()[1:]) for u in utterances]:
    caps.update(re.findall(r"\b[A-Z][a-z]+\b", text))
  for text in sorted(literals) + utterances:
    lower.update(re.findall(r"\b[a-z]+\b", text))
  names = caps - symbols
  lower_names = {n.lower() for n in names} - lower
  return sorted(literals), sorted(names | lower_names), utterances, programs


def _violations(texts, literals, names):
  """(document index, private entity or name) of every occurrence: literals
  case-insensitively as whole words, names as words, case-sensitively."""
  phrase = re.compile(r"(?<!\w)(?:" + "|".join(
      re.escape(x.lower()) for x in sorted(literals, key=len, reverse=True))
                      + r")(?!\w)")
  names = set(names)
  out = []
  for i, text in enumerate(texts):
    out += [(i, m.group(0)) for m in phrase.finditer(text.lower())]
    out += [(i, w) for w in re.findall(r"\w+", text) if w in names]
  return out


def test_committed_corpus_equals_fresh_generation(tmp_path):
  stats = generate.generate_public_corpus(str(tmp_path))
  assert sorted(os.listdir(PUBLIC)) == sorted(os.listdir(tmp_path)) == sorted(FILES)
  for name in FILES:
    with open(tmp_path / name, "rb") as f:
      assert f.read() == _read(name).encode("utf-8"), (
          f"{name}: rerun python -m tasks.semparse_sample.generate --public_corpus")
  for split, texts in public_corpora.documents(PUBLIC).items():
    name = f"{split}.jsonl"
    assert stats[split]["documents"] == len(texts)
    assert stats[split]["words"] == sum(len(t.split()) for t in texts)
    assert stats[split]["bytes"] == os.path.getsize(os.path.join(PUBLIC, name))
    assert f"| documents | {stats['train']['documents']} | " in _read("README.md")


def test_cli_flag_writes_the_public_corpus(monkeypatch):
  calls = []
  monkeypatch.setattr(generate, "generate_public_corpus",
                      lambda out: calls.append(out) or {})
  monkeypatch.setattr(generate, "generate", lambda *a, **k: calls.append("sample"))
  generate.main(["--public_corpus"])
  generate.main(["--public_corpus", "--output_dir=/some/where"])
  assert calls == [generate.DEFAULT_PUBLIC_DIR, "/some/where"]
  assert generate.DEFAULT_PUBLIC_DIR == os.path.join(
      os.path.dirname(semparse_tasks.DEFAULT_VOCAB_DIR), "semparse_public")
  assert generate.PUBLIC_SEED not in (3101, 3102, 4101, 4102)


def test_no_private_entity_or_name_in_the_public_corpus(docs, private):
  literals, names, utterances, _ = private
  # The checked sets are the private world's entities, not an empty filter.
  assert len(literals) > 150 and len(names) > 80
  for name in ("Arvel", "Vantrell", "Brindlemere", "Heron", "Inn", "Zoo"):
    assert name in names
  for literal in ("lunch", "the library", "buy milk", "happy birthday", "park"):
    assert literal in literals
  assert {"Room", "arvel", "old"} <= set(names) and "room" not in names
  assert not {"Monday", "March", "Hotel"} & set(names)
  # The check finds the private utterances' own entities (it can fail) ...
  assert len(_violations(utterances, literals, names)) > 1000
  # ... and none in the public documents.
  for split, texts in docs.items():
    found = _violations(texts, literals, names)
    assert not found, f"{split}: {collections.Counter(w for _, w in found)}"


def test_format_splits_and_sizes(docs):
  assert public_corpora.check_format_and_sizes(PUBLIC) == docs


def test_documents_are_task_texts_in_the_private_language(docs, private):
  """Each document is `parse_prompt(program) + utterance` with a canonical
  linearized Lispress program, or `domain_prompt(domain) + utterance` with a
  TreeDST domain; no special tokens; together they call every function type
  of the private programs."""
  domains = set(semparse.TREEDST_DOMAIN_TYPES.values())
  types, kinds = set(), collections.Counter()
  for text in docs["train"] + docs["validation"]:
    head, utterance = text.split(_UTTERANCE)
    assert utterance.strip() and "\n" not in utterance
    assert "<|" not in text and "<extra_id" not in text and text.isascii()
    if head.startswith("domain: "):
      assert head[len("domain: "):] in domains
      assert text == semparse_tasks.domain_prompt(head[8:]) + utterance
      kinds["domain"] += 1
    else:
      program = head[len("parse: "):]
      assert text == semparse_tasks.parse_prompt(program) + utterance
      assert lispress.linearize(program) == program
      types.update(lispress.function_types(program))
      kinds["parse"] += 1
  assert kinds["parse"] > 4 * kinds["domain"] > 0
  private_types = {f for p in private[3] for f in lispress.function_types(p)}
  assert private_types <= types


def test_tokenizers(docs, private):
  """GPT-2 BPE: documents round-trip, prompt + utterance tokenize as the task
  concatenates them, tokens per word near the private sample's; the T5
  SentencePiece model: unk rate not above the private parser texts'."""
  vocab = semparse_tasks.DEFAULT_VOCAB_DIR
  bpe = ByteLevelBPETokenizer(os.path.join(vocab, "vocab.json"),
                              os.path.join(vocab, "merges.txt"))
  texts = docs["train"] + docs["validation"]
  encoded = bpe.encode_batch(texts)
  assert [bpe.decode(e.ids) for e in encoded] == texts
  cut = [t.index(_UTTERANCE) + len(_UTTERANCE) for t in texts]
  prompts = bpe.encode_batch([t[:c] for t, c in zip(texts, cut)])
  targets = bpe.encode_batch([t[c:] for t, c in zip(texts, cut)])
  assert [p.ids + q.ids for p, q in zip(prompts, targets)] == [e.ids for e in encoded]
  public_tpw = sum(len(e.ids) for e in encoded) / sum(len(t.split()) for t in texts)
  _, _, utterances, programs = private
  priv_texts = [semparse_tasks.parse_prompt(lispress.linearize(p)) + u
                for p, u in zip(programs, utterances)]
  priv_tpw = (sum(len(e.ids) for e in bpe.encode_batch(priv_texts))
              / sum(len(t.split()) for t in priv_texts))
  assert public_tpw <= 1.25 * priv_tpw, (public_tpw, priv_tpw)

  sp = spm.SentencePieceProcessor(model_file=semparse_tasks.DEFAULT_SENTENCEPIECE_PATH)

  def unk_rate(strings):
    pieces = sp.encode(strings)
    return sum(x.count(sp.unk_id()) for x in pieces) / sum(len(x) for x in pieces)

  private_rate = unk_rate(utterances + [lispress.linearize(p) for p in programs])
  assert unk_rate(texts) <= private_rate
  # The check can fail: a character outside the model's pieces is unk.
  assert unk_rate(["utterance:\u00e9t\u00e9 \u4e2d"]) > 0
