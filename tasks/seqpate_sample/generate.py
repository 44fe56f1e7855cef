"""Deterministic generator of small AirDialogue- and Europarl-format samples.

Run ``python -m tasks.seqpate_sample.generate`` (optionally ``--output_dir``)
to (re)create, under ``tasks/data/seqpate_sample/``:

* ``airdialogue/{train,dev}_data.json``: flight-booking dialogues between a
  customer and an agent in the AirDialogue release format (one JSON object
  per line: ``intent``, ``action``, ``expected_action``, ``timestamps``,
  ``search_info``, ``correct_sample``, ``dialogue``; see `tasks.seqpate`;
  consecutive utterances of one speaker are merged, as in release v1.1).
  Customers are invented full names; a customer has one or many dialogues
  (a few heavy users), and their name appears inside utterances (e.g. "...,
  my name is Tamsin Oakhurst.", "Thank you for waiting, Tamsin Oakhurst,
  ..."), so the rate at which a model generates private names is measurable;
* ``europarl/europarl-v6.en``: parliament-style English sentences, one per
  line (WMT11's monolingual Europarl format), some shorter than 8 words;
* ``vocab/``: a GPT-2-format byte-level BPE (``vocab.json``, ``merges.txt``;
  the 256 byte tokens first, ``<|endoftext|>`` last) trained on both
  samples' train sentences;
* a ``README.md`` with statistics in each directory.

``python -m tasks.seqpate_sample.generate --public_corpus`` (optionally
``--output_dir``) writes instead the public pretraining corpus under
``tasks/data/seqpate_public/`` (`generate_public_corpus`): sentences in the
samples' language about other customers, airports and topics.

All names are invented; airport codes, months and airline names are the
kind the real AirDialogue uses. Determinism: one ``random.Random`` per file
from fixed seeds and only ordered containers; BPE is trained on a fixed
list of texts.

Needs the standard library, ``tokenizers`` and the (pure Python)
`tasks.seqpate` readers; no TensorFlow.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random

from dpjax.data.readers import seqpate, text_corpus
from tasks.semparse_sample.generate import EOS_TOKEN, train_bpe

SEEDS = {"users": 6100, "train": 6101, "dev": 6102, "europarl": 6201}
NUM_USERS = 120
NUM_DIALOGUES = {"train": 420, "dev": 60}
NUM_EUROPARL = 2400

DEFAULT_OUTPUT_DIR = os.path.dirname(seqpate.DEFAULT_VOCAB_DIR)
DIRS = {"airdialogue": "airdialogue", "europarl": "europarl", "vocab": "vocab"}

_FIRST = ("Arvel", "Bretta", "Corin", "Dalia", "Edrin", "Fenna", "Garrick",
          "Hesper", "Ilsa", "Joran", "Kestra", "Lorne", "Mirela", "Nolan",
          "Oriel", "Petra", "Quill", "Rosalind", "Soren", "Tamsin", "Ulric",
          "Vesna", "Wendel", "Yara", "Zora", "Alder", "Briony", "Casimir",
          "Delphine", "Emrys", "Fiora", "Gideon", "Halcyon", "Isolde")
_LAST = ("Vantrell", "Oakhurst", "Brisby", "Calloway", "Dunmore", "Ellery",
         "Farrow", "Galloway", "Hartwell", "Isley", "Jessup", "Kettering",
         "Larkspur", "Merriweather", "Norcott", "Pembrook", "Quenby",
         "Rathmore", "Selwyn", "Thistlewood", "Underhill", "Valcourt")
_AIRPORTS = ("ATL", "BOS", "CLT", "DCA", "DEN", "DFW", "DTW", "EWR", "HOU",
             "IAD", "IAH", "JFK", "LAS", "LAX", "LGA", "MCO", "MSP", "OAK",
             "ORD", "PHL", "PHX", "SEA", "SFO")
_AIRLINES = ("UA", "AA", "Delta", "Southwest", "Hawaiian", "Frontier",
             "JetBlue", "Spirit")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "June", "July", "Aug", "Sept",
           "Oct", "Nov", "Dec")
_TIMES = ("morning", "afternoon", "evening", "all")
_CLASSES = ("economy", "business", "all")


def _users(rng: random.Random) -> list[str]:
  names = [f"{f} {l}" for f in _FIRST for l in _LAST]
  return rng.sample(names, NUM_USERS)


def _intent(rng: random.Random, name: str, goal: str,
            airports: tuple[str, ...] = _AIRPORTS) -> dict:
  origin, dest = rng.sample(airports, 2)
  month = rng.randrange(12)
  day = rng.randint(1, 25)
  return {
      "departure_airport": origin, "return_airport": dest,
      "departure_month": _MONTHS[month], "departure_day": str(day),
      "return_month": _MONTHS[month], "return_day": str(day + rng.randint(1, 3)),
      "name": name, "departure_time": rng.choice(_TIMES),
      "return_time": rng.choice(_TIMES), "class": rng.choice(_CLASSES),
      "max_price": rng.choice((200, 500, 1000, 5000)),
      "max_connections": rng.choice((0, 1, 2)),
      "airline_preference": rng.choice(("normal-cost", "all")), "goal": goal,
  }


def _greeting(rng):
  return [("customer", rng.choice(("Hi.", "Hello.", "Hello agent."))),
          ("agent", rng.choice(("Hello. How may I help you today?",
                                "Hello, how can I assist you?",
                                "Hi, how may I help you?")))]


def _introduce(rng, name: str, it: dict) -> str:
  trip = f"from {it['departure_airport']} to {it['return_airport']}"
  return rng.choice((
      f"I would like to book a flight ticket {trip}, my name is {name}.",
      f"Can you please help me to book a ticket {trip}? I am {name}.",
      f"I am planning a trip {trip}, please book a ticket under the name "
      f"{name}.",
      f"This is {name}, I need a flight {trip} for a family function.",
  ))


def _book(rng, name: str, it: dict) -> tuple[list, dict]:
  first = name.split()[0]
  flight = rng.randint(1000, 1029)
  airline = rng.choice(_AIRLINES)
  price = rng.choice((100, 200, 300, 400, 500, 600, 800))
  found = rng.random() < 0.8
  turns = _greeting(rng) + [
      ("customer", _introduce(rng, name, it)),
      ("agent", rng.choice(("Sure, may I know your travel dates please?",
                            "Sure, can you please share your planned travel "
                            "dates?"))),
      ("customer", f"My travel dates are {it['departure_month']} "
                   f"{it['departure_day']} and {it['return_month']} "
                   f"{it['return_day']}."),
      ("agent", "Do you have any connection limit or class preference?"),
      ("customer", rng.choice((
          f"I prefer {it['class']} class with at most "
          f"{it['max_connections']} connection.",
          "I need a connecting flight and the price should be below "
          f"{it['max_price']}."))),
      ("agent", "Please wait for a moment while I check the availability."),
  ]
  if found:
    turns += [
        ("agent", rng.choice((
            f"Thank you for waiting, {name}, there is a flight {flight} in "
            f"{airline} airline with a fare of {price}.",
            f"{first}, I found flight {flight} of {airline} airline with one "
            f"connection and a price of {price}."))),
        ("customer", rng.choice(("Please proceed with the booking.",
                                 "That is fine for me, please book it."))),
        ("agent", f"Your ticket has been booked with flight {flight}, {name}."),
    ]
    action = {"status": "book", "name": name, "flight": [flight]}
  else:
    turns += [
        ("agent", f"Sorry {name}, there are no flights available on your "
                  "dates with your preferences."),
        ("customer", "That is okay, thank you for checking."),
    ]
    action = {"status": "no_flight", "name": name, "flight": []}
  turns.append(("agent", rng.choice(("Thank you for choosing us.",
                                     "Thank you for reaching us, have a nice "
                                     "day."))))
  return turns, action


def _change_or_cancel(rng, name: str, it: dict, goal: str) -> tuple[list, dict]:
  has_reservation = rng.random() < 0.7
  turns = _greeting(rng) + [
      ("customer", rng.choice((
          f"I want to {goal} my existing reservation, my name is {name}.",
          f"Can you help me to {goal} my reservation? I am {name}.",
          f"My name is {name}, I need to {goal} my recent reservation due to "
          "an emergency."))),
      ("agent", "Please wait for a moment while I check your reservation."),
  ]
  if has_reservation:
    flight = rng.randint(1000, 1029)
    turns += [
        ("agent", f"I found a reservation under the name {name}, do you want "
                  f"me to {goal} it?"),
        ("customer", "Yes, please go ahead with it."),
        ("agent", f"Your reservation has been {goal}ed successfully, "
                  f"{name.split()[0]}." if goal == "cancel" else
         f"Your reservation has been changed to flight {flight}, {name}."),
    ]
    action = {"status": goal, "name": name,
              "flight": [] if goal == "cancel" else [flight]}
  else:
    turns += [
        ("agent", f"Sorry {name}, there is no reservation found under your "
                  "name."),
        ("customer", "Okay, thank you for checking my details."),
    ]
    action = {"status": "no_reservation", "name": name, "flight": []}
  turns.append(("agent", "Thank you for reaching us."))
  return turns, action


def _dialogue_record(rng: random.Random, name: str,
                     airports: tuple[str, ...] = _AIRPORTS) -> dict:
  """One dialogue as an AirDialogue release record (a dict)."""
  goal = rng.choices(("book", "change", "cancel"), (0.7, 0.15, 0.15))[0]
  it = _intent(rng, name, goal, airports)
  if goal == "book":
    turns, action = _book(rng, name, it)
  else:
    turns, action = _change_or_cancel(rng, name, it, goal)
  # As in release v1.1, consecutive utterances of one speaker are one.
  merged = []
  for speaker, text in turns:
    if merged and merged[-1][0] == speaker:
      merged[-1] = (speaker, f"{merged[-1][1]} {text}")
    else:
      merged.append((speaker, text))
  turns = merged
  start = 1_500_000_000 + rng.randrange(10**7)
  return {
      "intent": it, "action": action, "expected_action": action,
      "timestamps": [start + 7 * k for k in range(len(turns))],
      "search_info": [], "correct_sample": True,
      "dialogue": [f"{speaker}: {text}" for speaker, text in turns],
  }


def _dialogue(rng: random.Random, name: str) -> str:
  return json.dumps(_dialogue_record(rng, name), ensure_ascii=False,
                    separators=(",", ":"))


def build_airdialogue(split: str) -> list[str]:
  """The JSONL lines of one AirDialogue file."""
  users = _users(random.Random(SEEDS["users"]))
  rng = random.Random(SEEDS[split])
  # Zipf-like activity: a few customers have many dialogues.
  weights = [1.0 / (rank + 1) ** 0.6 for rank in range(len(users))]
  return [_dialogue(rng, rng.choices(users, weights)[0])
          for _ in range(NUM_DIALOGUES[split])]


_OPENERS = ("Mr President", "Madam President", "Ladies and gentlemen",
            "Commissioner", "Mr President-in-Office of the Council",
            "Honourable Members")
_TOPICS = ("the common fisheries policy", "energy security",
           "the internal market", "the protection of consumers",
           "regional development", "the rights of workers",
           "the enlargement of the Union", "food safety",
           "the reform of the structural funds", "climate change",
           "the fight against terrorism", "maritime safety",
           "public health", "the single currency", "rural development",
           "the transport of animals", "research and innovation",
           "the stability and growth pact", "data protection",
           "the external borders of the Union")
_ACTORS = ("the Commission", "the Council", "this Parliament",
           "the Member States", "my group", "the rapporteur")
_YEARS = tuple(str(y) for y in range(1999, 2011))
_SHORT = ("The debate is closed.", "(Applause)", "The vote will take place "
          "tomorrow.", "That is not acceptable.", "I have two questions.",
          "The minutes were approved.", "We must act now.")


def _europarl_sentence(rng: random.Random,
                       topics: tuple[str, ...] = _TOPICS) -> str:
  if rng.random() < 0.08:
    return rng.choice(_SHORT)
  topic, other = rng.sample(topics, 2)
  actor = rng.choice(_ACTORS)
  year = rng.choice(_YEARS)
  clause = rng.choice((
      f"I would like to thank the rapporteur for her excellent report on "
      f"{topic}",
      f"{actor} must present a proposal on {topic} before the end of {year}",
      f"we cannot accept that {topic} is treated as a secondary issue by "
      f"{actor}",
      f"my group will vote in favour of this report because it strengthens "
      f"{topic}",
      f"the report rightly points out that {topic} and {other} are closely "
      "linked",
      f"I should like to point out that {actor} has already adopted a "
      f"position on {topic}",
      f"it is regrettable that the budget for {topic} was cut in {year}",
      f"we need a coherent strategy for {topic} which also takes account of "
      f"{other}",
  ))
  if rng.random() < 0.5:
    return f"{rng.choice(_OPENERS)}, {clause}."
  return clause[0].upper() + clause[1:] + "."


def build_europarl() -> list[str]:
  rng = random.Random(SEEDS["europarl"])
  return [_europarl_sentence(rng) for _ in range(NUM_EUROPARL)]


def _write_lines(path: str, lines) -> None:
  with open(path, "w", encoding="utf-8", newline="\n") as f:
    for line in lines:
      f.write(line + "\n")


def _stats_rows(sentences: list[seqpate.Sentence]) -> list[str]:
  examples = seqpate.completion_examples(sentences)
  words = [len(s.text.split()) for s in sentences]
  return [
      f"| sentences / completion examples (>= {seqpate.MIN_WORDS} words) | "
      f"{len(sentences)} / {len(examples)} |",
      f"| words per sentence: mean / max | {sum(words) / len(words):.1f} / "
      f"{max(words)} |",
  ]


def _airdialogue_readme(splits: dict[str, list[seqpate.Sentence]]) -> str:
  rows = ["# seqpate_sample/airdialogue", "",
          "Fictional flight-booking dialogues in the AirDialogue release "
          "format,", "generated by `python -m tasks.seqpate_sample.generate` "
          "(deterministic; do", "not edit by hand). Sentences are utterances; "
          "the user id is `intent.name`.", "",
          "| statistic | value |", "| --- | --- |"]
  for split, sentences in splits.items():
    rows += [r.replace("| ", f"| {split}: ", 1) for r in _stats_rows(sentences)]
    users = collections.Counter(s.user_id for s in sentences)
    rows.append(f"| {split}: users / sentences of the busiest user | "
                f"{len(users)} / {max(users.values())} |")
  return "\n".join(rows) + "\n"


def _europarl_readme(sentences: list[seqpate.Sentence]) -> str:
  return "\n".join([
      "# seqpate_sample/europarl", "",
      "Fictional parliament-style sentences, one per line (the format of "
      "WMT11's", "`europarl-v6.en`), generated by `python -m "
      "tasks.seqpate_sample.generate`.", "",
      "| statistic | value |", "| --- | --- |", *_stats_rows(sentences)]) + "\n"


def _vocab_readme(texts: list[str], output_dir: str) -> str:
  from tokenizers import ByteLevelBPETokenizer  # pylint: disable=g-import-not-at-top

  bpe = ByteLevelBPETokenizer(os.path.join(output_dir, "vocab.json"),
                              os.path.join(output_dir, "merges.txt"))
  lengths = [len(e.ids) for e in bpe.encode_batch(texts)]
  return "\n".join([
      "# seqpate_sample/vocab", "",
      "GPT-2-format byte-level BPE of the SeqPATE samples, trained by",
      "`python -m tasks.seqpate_sample.generate` on the train sentences of "
      "both samples:", f"{bpe.get_vocab_size()} tokens (the 256 bytes first, "
      f"`{EOS_TOKEN}` last = EOS).", "",
      "| statistic | value |", "| --- | --- |",
      f"| BPE tokens per train sentence: mean / max | "
      f"{sum(lengths) / len(lengths):.1f} / {max(lengths)} |"]) + "\n"


def _write_text(path: str, text: str) -> None:
  with open(path, "w", encoding="utf-8", newline="\n") as f:
    f.write(text)


def generate(output_dir: str = DEFAULT_OUTPUT_DIR) -> dict:
  """Writes both samples and the vocabulary under `output_dir`; returns the
  sentences as read back: {"airdialogue": {split: [...]}, "europarl": [...]}."""
  air_dir = os.path.join(output_dir, DIRS["airdialogue"])
  euro_dir = os.path.join(output_dir, DIRS["europarl"])
  vocab_dir = os.path.join(output_dir, DIRS["vocab"])
  for d in (air_dir, euro_dir, vocab_dir):
    os.makedirs(d, exist_ok=True)
  air = {}
  for split in seqpate.AIRDIALOGUE_FILES:
    _write_lines(os.path.join(air_dir, seqpate.AIRDIALOGUE_FILES[split]),
                 build_airdialogue(split))
    air[split] = seqpate.load_airdialogue(split, air_dir)
  euro_path = os.path.join(euro_dir, os.path.basename(
      seqpate.DEFAULT_EUROPARL_PATH))
  _write_lines(euro_path, build_europarl())
  euro = seqpate.load_europarl(euro_path)
  texts = [s.text for s in air["train"] + euro]
  train_bpe(texts, vocab_dir)
  _write_text(os.path.join(air_dir, "README.md"), _airdialogue_readme(air))
  _write_text(os.path.join(euro_dir, "README.md"), _europarl_readme(euro))
  _write_text(os.path.join(vocab_dir, "README.md"),
              _vocab_readme(texts, vocab_dir))
  return {"airdialogue": air, "europarl": euro}


# --- Public pretraining corpus ----------------------------------------------
#
# The same language as the samples (the same dialogue and parliament
# templates, rendered as the model reads the private sentences) with entity
# pools disjoint from the samples': other invented customer names, other
# airports, other parliamentary topics. See `generate_public_corpus`.

PUBLIC_SEED = 6300
DEFAULT_PUBLIC_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
    "seqpate_public")
PUBLIC_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}
PUBLIC_DIALOGUES = 1000
PUBLIC_EUROPARL = 4800
# Units (dialogues, Europarl sentences) drawn into validation; validation
# documents whose text also occurs in train (template utterances) are then
# dropped, leaving about 5% of the documents.
PUBLIC_VALIDATION_UNITS = 0.1

_PUBLIC_FIRST = ("Abelard", "Brielle", "Cassius", "Dorian", "Elowen",
                 "Faustin", "Greer", "Hollis", "Imogen", "Jasper", "Kerensa",
                 "Leander", "Maelis", "Niamh", "Osric", "Perpetua", "Quinlan",
                 "Rowena", "Sylvan", "Thea", "Ulla", "Valentin", "Wilhelmina",
                 "Xanthe", "Yorick", "Zephyr", "Anselm", "Bettina",
                 "Cordelia", "Desmond", "Evander", "Florian", "Gwendolyn",
                 "Horatio", "Ingrid", "Juniper")
_PUBLIC_LAST = ("Ashcombe", "Blackwood", "Cresswell", "Dunstable", "Eversley",
                "Fairbrook", "Glenister", "Holloway", "Inchbald", "Jarrow",
                "Kingsmill", "Lockwood", "Marchbanks", "Netherby", "Ormsby",
                "Penhallow", "Quarrington", "Redfern", "Stanhope",
                "Tregarthen", "Upfield", "Wexcombe", "Yelverton", "Ashdown")
_PUBLIC_AIRPORTS = ("SAN", "SLC", "PDX", "MIA", "TPA", "STL", "BNA", "AUS",
                    "MSY", "RDU", "SJC", "SMF", "MCI", "CLE", "PIT", "IND",
                    "CMH", "SAT", "BWI", "MDW", "FLL", "HNL", "ABQ", "BUR",
                    "MKE")
_PUBLIC_TOPICS = ("the common agricultural policy", "asylum and migration",
                  "the protection of the environment", "competition policy",
                  "the European arrest warrant", "nuclear safety",
                  "the fight against poverty",
                  "equal opportunities for women and men",
                  "air passenger rights", "the trans-European networks",
                  "cohesion policy", "development aid",
                  "human rights in third countries", "the Lisbon strategy",
                  "small and medium-sized enterprises",
                  "the common foreign and security policy",
                  "the protection of minors", "organised crime",
                  "the working time directive", "renewable energy sources",
                  "water quality", "the Schengen area", "road safety",
                  "the postal services", "waste management",
                  "the pharmaceutical industry")


def _check_public_pools() -> None:
  """Raises ValueError if a public entity pool meets the samples' pools."""
  sample_names = set(_FIRST) | set(_LAST)
  public_names = set(_PUBLIC_FIRST) | set(_PUBLIC_LAST)
  clashes = {
      "names": sample_names & public_names,
      "airports": set(_AIRPORTS) & set(_PUBLIC_AIRPORTS),
      "topics": set(_TOPICS) & set(_PUBLIC_TOPICS),
      # A public name must not be any other word of the samples' pools.
      "names vs. other pools": public_names & set(
          " ".join(_AIRPORTS + _AIRLINES + _MONTHS + _TOPICS + _ACTORS
                   + _OPENERS + _SHORT).replace(",", " ").split()),
  }
  clashes = {k: sorted(v) for k, v in clashes.items() if v}
  if clashes:
    raise ValueError(f"public pools overlap the sample's: {clashes}")


def _public_documents(texts: list[str]) -> list[str]:
  """The texts as the private LM reads them: `completion_examples`' rule
  (>= MIN_WORDS words, cut at MAX_WORDS, single-spaced)."""
  return [c.text for c in seqpate.completion_examples(
      seqpate.Sentence(t, None, "public") for t in texts)]


def _sample_sentence_users() -> dict[str, int]:
  """{text: number of customers}: the sample's sentences (as
  `_public_documents` renders them) with the number of distinct customers
  whose dialogues contain them (0 for Europarl's)."""
  users = collections.defaultdict(set)
  for split in NUM_DIALOGUES:
    for line in build_airdialogue(split):
      record = json.loads(line)
      texts = [t.partition(":")[2].strip() for t in record["dialogue"]]
      for doc in _public_documents(texts):
        users[doc].add(record["intent"]["name"])
  for doc in _public_documents(build_europarl()):
    users.setdefault(doc, set())
  return {doc: len(names) for doc, names in users.items()}


def build_public_units(seed: int = PUBLIC_SEED
                       ) -> tuple[list[list[str]], int]:
  """(units, dropped): the public corpus' units in order, each a dialogue's
  documents (its utterances without speaker tags) or one Europarl
  sentence's. A document equal to a sample sentence is kept only if that
  sentence is a template shared by at least two sample customers (e.g. "Do
  you have any connection limit or class preference?"); `dropped` counts
  the others: chance equalities such as one customer's "My travel dates are
  <month> <day> and <month> <day>." (and any Europarl sentence of the sample)."""
  _check_public_pools()
  sample = _sample_sentence_users()
  rng = random.Random(seed)
  names = [f"{f} {l}" for f in _PUBLIC_FIRST for l in _PUBLIC_LAST]
  units = []
  for _ in range(PUBLIC_DIALOGUES):
    record = _dialogue_record(rng, rng.choice(names), _PUBLIC_AIRPORTS)
    units.append(_public_documents(
        [turn.partition(":")[2].strip() for turn in record["dialogue"]]))
  for _ in range(PUBLIC_EUROPARL):
    units.append(_public_documents([_europarl_sentence(rng,
                                                       _PUBLIC_TOPICS)]))
  kept = [[d for d in u if sample.get(d, 2) >= 2] for u in units]
  dropped = sum(map(len, units)) - sum(map(len, kept))
  units = [u for u in kept if u]
  rng.shuffle(units)
  return units, dropped


def public_splits(seed: int = PUBLIC_SEED
                  ) -> tuple[dict[str, list[str]], int]:
  """({"train", "validation"}: documents, dropped); a validation document's
  text never occurs in train; `dropped` as in `build_public_units`."""
  rng = random.Random(seed + 1)
  train, validation = [], []
  units, dropped = build_public_units(seed)
  for unit in units:
    (validation if rng.random() < PUBLIC_VALIDATION_UNITS else train).extend(
        unit)
  in_train = set(train)
  return {"train": train,
          "validation": [d for d in validation if d not in in_train]}, dropped


def _public_readme(splits: dict[str, list[str]], sizes: dict[str, int],
                   dropped: int) -> str:
  from tokenizers import ByteLevelBPETokenizer  # pylint: disable=g-import-not-at-top

  bpe = ByteLevelBPETokenizer(
      os.path.join(seqpate.DEFAULT_VOCAB_DIR, "vocab.json"),
      os.path.join(seqpate.DEFAULT_VOCAB_DIR, "merges.txt"))

  def per_word(docs):
    tokens = [len(e.ids) for e in bpe.encode_batch(docs)]
    return (sum(tokens) / sum(len(d.split()) for d in docs), max(tokens))

  private = [c.text for c in seqpate.completion_examples(
      seqpate.load_airdialogue("train") + seqpate.load_europarl())]
  rows = ["| split | documents | unique | words | characters | file bytes |",
          "| --- | --- | --- | --- | --- | --- |"]
  for split, docs in splits.items():
    rows.append(f"| {split} | {len(docs)} | {len(set(docs))} | "
                f"{sum(len(d.split()) for d in docs)} | "
                f"{sum(len(d) for d in docs)} | {sizes[split]} |")
  pub_tpw, pub_max = per_word(splits["train"])
  pri_tpw, pri_max = per_word(private)
  return "\n".join([
      "# seqpate_public", "",
      "A public pretraining corpus for the SeqPATE world: fictional "
      "flight-booking", "utterances (AirDialogue-like) and "
      "parliament-style sentences (Europarl-like),", "in the language of "
      "`tasks/data/seqpate_sample/` but about other entities, for",
      "pretraining a tiny GPT-2 non-privately before DP fine-tuning on the "
      "private", "sample. Generated deterministically (seed "
      f"{PUBLIC_SEED}; do not edit by hand) by", "",
      "    python -m tasks.seqpate_sample.generate --public_corpus", "",
      "## Format", "",
      "`train.jsonl`, `validation.jsonl`: one `{\"text\": doc}` per line "
      "(UTF-8). A", "document is one sentence, rendered exactly as the "
      "private LM rows read", "theirs (`dpjax.data.readers.seqpate`, "
      "`tasks.seqpate`): an AirDialogue utterance", "without its "
      "`customer:`/`agent:` tag (consecutive utterances of one speaker",
      "merged, as in the sample), or a Europarl sentence; only sentences of "
      f">= {seqpate.MIN_WORDS}", f"words, cut at {seqpate.MAX_WORDS} words, "
      "single-spaced (`completion_examples`). No", "special tokens (the "
      "model's BOS/EOS `<|endoftext|>` is added by the reader).",
      f"Units: {PUBLIC_DIALOGUES} dialogues and {PUBLIC_EUROPARL} Europarl "
      "sentences, shuffled;", "a unit goes to validation with probability "
      f"{PUBLIC_VALIDATION_UNITS}, and validation documents whose", "text "
      "also occurs in train (entity-free template utterances) are dropped, "
      "so no", "document is in both splits. Train keeps the natural "
      "frequencies of template", "utterances (repeated texts), as the "
      "private sample has them.", "",
      "## Statistics", "", *rows, "",
      "Tokenizer: the sample's GPT-2 byte-level BPE "
      "(`tasks/data/seqpate_sample/vocab/`),", "so every text encodes "
      "without unknown tokens. BPE tokens per word: public train",
      f"{pub_tpw:.2f} (max {pub_max} tokens per document), private sample "
      f"completion texts", f"{pri_tpw:.2f} (max {pri_max}): the public "
      "names, airports and topics were not seen", "when the BPE was "
      "trained, so they split into more pieces.", "",
      "## Disjointness from the private sample", "",
      "* Customer names: first and last names from pools disjoint from the "
      "sample's", "  (`_PUBLIC_FIRST`, `_PUBLIC_LAST` vs. `_FIRST`, `_LAST`), "
      "so no private customer's", "  first or last name occurs; the "
      "name-leakage evaluation looks for those.",
      "* Airports: other US airport codes (`_PUBLIC_AIRPORTS` vs. "
      "`_AIRPORTS`).", "* Europarl topics: other policy topics "
      "(`_PUBLIC_TOPICS` vs. `_TOPICS`), so no", "  public sentence equals "
      "a private, public-split or test Europarl sentence.",
      "* Shared on purpose (the world's language, not entities): the "
      "templates, months,", "  days, prices, flight numbers, airline names, "
      "years, openers and actors. A", "  public document equal to a sample "
      "sentence is an entity-free AirDialogue", "  template utterance that "
      "occurs in the dialogues of at least two sample", "  customers; "
      "chance equalities with one customer's sentence (\"My travel dates",
      f"  are <month> <day> and <month> <day>.\") are dropped: {dropped} "
      "documents.", "",
      "The sample's `public` split (SeqPATE's public prefixes, "
      "`completion_splits`) and", "its test sets (`dev_data.json`, "
      "Europarl's test split) are part of the sample,", "so this corpus "
      "is disjoint from them in the same way: pretraining on it gives",
      "the model neither a private customer nor an evaluation sentence.",
      "`_check_public_pools` enforces the pool disjointness at generation "
      "time;", "`tests/seqpate/test_seqpate_public_corpus.py` checks it "
      "against the committed", "sample files (names and airports read from "
      "their `intent` fields, Europarl", "sentences) independently of the "
      "generator."]) + "\n"


def generate_public_corpus(output_dir: str = DEFAULT_PUBLIC_DIR, *,
                           seed: int = PUBLIC_SEED) -> dict:
  """Writes `train.jsonl`, `validation.jsonl` and `README.md` of the public
  corpus under `output_dir`; returns {split: {"documents", "words",
  "characters", "bytes"}}."""
  splits, dropped = public_splits(seed)
  os.makedirs(output_dir, exist_ok=True)
  stats, sizes = {}, {}
  for split, docs in splits.items():
    path = os.path.join(output_dir, PUBLIC_FILES[split])
    text_corpus.write_documents(path, docs)
    sizes[split] = os.path.getsize(path)
    stats[split] = {"documents": len(docs),
                    "words": sum(len(d.split()) for d in docs),
                    "characters": sum(len(d) for d in docs),
                    "bytes": sizes[split]}
  _write_text(os.path.join(output_dir, "README.md"),
              _public_readme(splits, sizes, dropped))
  return stats


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=None,
                      help=f"default: {DEFAULT_OUTPUT_DIR}, or "
                      f"{DEFAULT_PUBLIC_DIR} with --public_corpus")
  parser.add_argument("--public_corpus", action="store_true",
                      help="write the public pretraining corpus instead of "
                      "the sample")
  args = parser.parse_args(argv)
  if args.public_corpus:
    output_dir = args.output_dir or DEFAULT_PUBLIC_DIR
    generate_public_corpus(output_dir)
    readmes = [os.path.join(output_dir, "README.md")]
  else:
    output_dir = args.output_dir or DEFAULT_OUTPUT_DIR
    generate(output_dir)
    readmes = [os.path.join(output_dir, name, "README.md")
               for name in DIRS.values()]
  for path in readmes:
    with open(path, encoding="utf-8") as f:
      print(f.read())


if __name__ == "__main__":
  main()
