"""The committed MultiDoGo public pretraining corpus
(`tasks/data/multidogo_public/`, `generate.py --public_corpus`): it is the
generator's output, it is disjoint from the private sample in the phrases
and entities that matter, it has the corpus format, and it encodes with the
sample's byte-level BPE. Disjointness is checked from the committed private
files themselves (`keywords.json` and the `.tsv` conversations), not from
the generator's public pools."""
import collections
import csv
import filecmp
import json
import os
import re

import pytest
import tokenizers

from dpjax.data.readers import multidogo
from tasks.multidogo_sample import generate
from tests import public_corpora

PUBLIC_DIR = generate.DEFAULT_PUBLIC_DIR
PRIVATE_DIR = generate.DEFAULT_OUTPUT_DIR
SPLITS = ("train", "validation")
FILES = ("README.md", "train.jsonl", "validation.jsonl")


@pytest.fixture(scope="module")
def docs():
  return public_corpora.documents(PUBLIC_DIR)


@pytest.fixture(scope="module")
def all_docs(docs):
  return [d for split in SPLITS for d in docs[split]]


def _private_utterances():
  """(role, text) of every row of the committed private sample files, read
  with `csv` directly (conversations in file order)."""
  rows = []
  for domain in generate.SEEDS:
    with open(os.path.join(PRIVATE_DIR, f"{domain.lower()}.tsv"), encoding="utf-8",
              newline="") as f:
      for row in csv.DictReader(f):
        rows.append((row["authorRole"], " ".join(row["utterance"].split())))
  return rows


def private_entities():
  """{kind: words} of the named entities in the committed private sample,
  read off by the sample's sentence frames: company names (greetings and
  closings), agent names ("You're connected to X."), customer names (the
  customer's answer to a name question, "Thanks X!", e-mail local parts),
  e-mail domains, cities ("from X to Y", "departing X", "X 12345" zip
  answers), street names ("12 X Street"), cars (answers "2015 X Y" to the
  make/model question) and flight codes ("flight XX 123"); lower case,
  words with a letter only (`_names`)."""
  out = collections.defaultdict(set)
  utterances = _private_utterances()
  frames = {
      "company": [r"You've reached (.+?) customer service",
                  r"Welcome to (.+?)\. You're", r"contacting (.+?)[!.]"],
      "agent": [r"You're connected to (\w+)\."],
      "customer": [r"^Thanks (\w+)!", r"thank you (\w+)!$", r"(?i)^my name is (\w+)$"],
      "city": [r"(?i)from (\w+) to (\w+)", r"departing (\w+) at",
               r"(?i)^(\w+) \d{5}$"],
      "street": [r"\d+ (\w+) (?:Street|Avenue|Road|Lane|Drive)\b"],
      "flight_code": [r"flight ([A-Z]{2}) \d{3}"],
  }
  previous = ""
  for role, text in utterances:
    for kind, patterns in frames.items():
      for pattern in patterns:
        for m in re.finditer(pattern, text):
          for g in m.groups():
            out[kind].update(g.lower().split())
    for local, domain in re.findall(r"([a-zA-Z]+)\d*@(\w+(?:\.\w+)+)", text):
      out["customer"].add(local.lower())
      out["mail_domain"].add(domain.lower())
    if role == "customer" and "name" in previous and not re.search(r"\d", text):
      words = text.lower().split()
      out["customer"].update(words[3:] if words[:3] == ["my", "name", "is"] else words)
    if role == "customer" and "make, model and year" in previous:
      out["car"].update(text.lower().split()[1:])
    previous = text if role == "agent" else previous
  return {k: _names(v) for k, v in out.items()}


def _tokens(text):
  return tuple(re.findall(r"[^\W\d_]+|\d+", text.lower()))


def _whole_word_hits(phrases, texts):
  """The phrases that occur in some text as whole words, any letter case:
  the phrase's tokens occur consecutively among a text's tokens, a token
  being a maximal run of letters or of digits, lower case. Whatever
  separates tokens is ignored, so "mailbox.com" is found in "x@mailbox.com",
  "make, model and year" in "make model and year", and "priya" in
  "priya12@..." (stricter than the keyword policy's whole words)."""
  phrase_tokens = {p: _tokens(p) for p in phrases}
  lengths = sorted({len(t) for t in phrase_tokens.values()})
  grams = set()
  for text in texts:
    tokens = _tokens(text)
    for n in lengths:
      grams.update(zip(*(tokens[i:] for i in range(n))))
  return [p for p, t in phrase_tokens.items() if t in grams]


def _names(words):
  """Entity words: those with a letter (a bare number such as the model
  number of "Mazda 3" names nothing)."""
  return sorted({w for w in words if re.search(r"[^\W\d_]", w)})


# --- (a) the committed corpus is the generator's output --------------------


def test_committed_corpus_is_the_generators_output(tmp_path):
  stats = generate.generate_public_corpus(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted(FILES)
  assert sorted(os.listdir(PUBLIC_DIR)) == sorted(FILES)
  for name in FILES:
    assert filecmp.cmp(tmp_path / name, os.path.join(PUBLIC_DIR, name),
                       shallow=False), name
  for split, split_docs in public_corpora.documents(PUBLIC_DIR).items():
    assert stats[split] == {"documents": len(split_docs),
                            "words": sum(len(d.split()) for d in split_docs),
                            "characters": sum(len(d) for d in split_docs)}
  assert stats["seed"] == generate.PUBLIC_SEED != 0
  assert generate.PUBLIC_SEED not in generate.SEEDS.values()


def test_cli_flag_and_seed(tmp_path):
  generate.main(["--public_corpus", f"--output_dir={tmp_path / 'cli'}"])
  for name in FILES:
    assert filecmp.cmp(tmp_path / "cli" / name, os.path.join(PUBLIC_DIR, name),
                       shallow=False), name
  generate.generate_public_corpus(str(tmp_path / "other"),
                                  seed=generate.PUBLIC_SEED + 1)
  assert (public_corpora.documents(tmp_path / "other")["train"]
          != public_corpora.documents(PUBLIC_DIR)["train"])


def test_readme_states_the_statistics_and_command(docs):
  with open(os.path.join(PUBLIC_DIR, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  assert "python -m tasks.multidogo_sample.generate --public_corpus" in readme
  for split in SPLITS:
    words = sum(len(d.split()) for d in docs[split])
    chars = sum(len(d) for d in docs[split])
    assert f"| {split} | {len(docs[split])} | {words} | {chars} |" in readme


# --- (b) disjointness from the private sample -------------------------------


def test_no_private_keyword_phrase(all_docs):
  """No phrase of the committed `keywords.json` (every domain: the private
  companies and domain terms the keyword policy and the domain attacks look
  for) occurs as whole words in any letter case; and the keyword policy
  itself flags no document."""
  from dpjax.data.text import redaction  # pylint: disable=g-import-not-at-top

  path = os.path.join(PRIVATE_DIR, "keywords.json")
  with open(path, encoding="utf-8") as f:
    keywords = json.load(f)
  assert sorted(keywords) == sorted(multidogo.PAPER_DOMAINS)
  phrases = [p for d in keywords for p in keywords[d]]
  assert len(phrases) > 40
  assert _whole_word_hits(phrases, all_docs) == []
  policy = redaction.KeywordPolicy.from_json(path)
  assert not any(policy.flags_batch(all_docs))


def test_no_private_entity(all_docs):
  """No named entity of the committed private sample (`private_entities`:
  company-name words, agent and customer names, e-mail domains, cities,
  streets, car makes/models, flight codes, each read off the private files
  by the sample's sentence frames) occurs in the public corpus as a whole
  word, any letter case. The street kinds (Street, Avenue, ...) and months
  are template words, not slot values, and are not extracted."""
  entities = private_entities()
  # The extraction found the private slot values (so the check has teeth).
  assert len(entities["customer"]) >= 30
  assert len(entities["agent"]) >= 5
  assert len(entities["city"]) >= 10
  assert len(entities["street"]) >= 8
  assert len(entities["company"]) >= 15
  assert len(entities["car"]) >= 8
  assert len(entities["flight_code"]) == 5
  assert len(entities["mail_domain"]) >= 3
  hits = {kind: _whole_word_hits(words, all_docs) for kind, words in entities.items()}
  assert hits == {kind: [] for kind in entities}


def test_no_word_of_the_samples_entity_pools(all_docs):
  """The same, for the sample generator's own entity pools (every word of
  them with a letter): what the private sample could contain, not only
  what it does."""
  pools = [*generate._FIRST, *generate._LAST, *generate._AGENTS,
           *generate._MAIL, *generate._CITIES, *generate._STREETS,
           *generate._CARS, *generate._FLIGHT_CODES.values(),
           *(n for names in generate.COMPANIES.values() for n in names)]
  words = _names(w for p in pools for w in p.split())
  assert _whole_word_hits(words, all_docs) == []


def test_the_checks_find_a_planted_private_entity(all_docs):
  planted = all_docs[0] + " Customer: PRIYA, i flew Skylark Airways"
  assert _whole_word_hits(private_entities()["customer"], [planted]) == ["priya"]
  mail = all_docs[0] + " Customer: ravi7@Mailbox.com"
  assert _whole_word_hits(["ravi", "mailbox.com", "postly.net"], [mail]) == [
      "ravi", "mailbox.com"]
  assert _whole_word_hits(["skylark airways", "airways", "seat"], [planted]) == [
      "skylark airways", "airways"]


# --- (c) format ---------------------------------------------------------------


def test_format_sizes_and_splits(docs):
  assert public_corpora.check_format_and_sizes(PUBLIC_DIR) == docs
  assert len(set(docs["train"])) == len(docs["train"])
  assert len(set(docs["validation"])) == len(docs["validation"])


def test_documents_are_conversations_without_control_tokens(all_docs):
  """One conversation per document, on one line: every utterance after
  `Agent:` or `Customer:`, both roles present; none of the task's control
  tokens (`<_soc_>`, `<_eoc_>`, `<REDACTED>`, `SYS:`, `USR:`, domain
  tokens) nor GPT-2's `<|endoftext|>`."""
  role = re.compile(r"(?:^| )(Agent|Customer): ")
  domains = collections.Counter()
  for doc in all_docs:
    assert "\n" not in doc and doc == " ".join(doc.split())
    assert re.match(r"(Agent|Customer): \S", doc)
    roles = role.findall(doc)
    assert {"Agent", "Customer"} <= set(roles) and len(roles) >= 6
    assert doc.endswith("Have a nice day!")
    for token in (*multidogo.CONTROL_TOKENS, "<|endoftext|>"):
      assert token not in doc
    company = re.search(r"contacting ([^.!]+)\. Have a nice day!$", doc)[1]
    domains.update(d for d, names in generate.PUBLIC_COMPANIES.items()
                   if company in names)
  # The three domains the sample lacks, in about equal shares.
  assert sorted(domains) == ["FASTFOOD", "FINANCE", "SOFTWARE"]
  assert sum(domains.values()) == len(all_docs)
  assert min(domains.values()) >= len(all_docs) // 3 - 1


# --- (d) the sample tokenizer ----------------------------------------------


def test_encodes_with_the_sample_bpe(all_docs):
  """Byte-level BPE has no unknown token: every document round-trips
  through the committed `bpe/` files, with ids inside their 2000-token
  vocabulary and no EOS. As a sanity figure of "same language", public
  tokens per word are within 1.5x of the private conversations' (rendered
  the same way)."""
  bpe = os.path.join(PRIVATE_DIR, "bpe")
  tok = tokenizers.ByteLevelBPETokenizer(os.path.join(bpe, "vocab.json"),
                                         os.path.join(bpe, "merges.txt"))
  size, eos = tok.get_vocab_size(), tok.token_to_id("<|endoftext|>")
  assert size == generate.BPE_VOCAB_SIZE
  encoded = tok.encode_batch(all_docs)
  for doc, enc in zip(all_docs, encoded):
    assert max(enc.ids) < size and eos not in enc.ids
    assert tok.decode(enc.ids) == doc
  public = sum(len(e.ids) for e in encoded) / sum(len(d.split()) for d in all_docs)
  private_docs = [generate.render_public([(u.role, u.text) for u in c.utterances])
                  for c in multidogo.load_conversations(PRIVATE_DIR)]
  private = (sum(len(e.ids) for e in tok.encode_batch(private_docs))
             / sum(len(d.split()) for d in private_docs))
  assert 1.0 < private < public < 1.5 * private
