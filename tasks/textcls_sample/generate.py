"""Deterministic generator of small SST-2- and AG News-format samples.

Run ``python -m tasks.textcls_sample.generate`` (optionally ``--output_dir``)
to (re)create ``tasks/data/textcls_sample/``:

* ``sst2/train.tsv``, ``sst2/dev.tsv``: GLUE's SST-2 layout (header
  ``sentence\\tlabel``; lower-cased, tokenized sentences and phrases with a
  trailing space, label 0 negative / 1 positive), balanced. Some sentences
  carry a concession of the other polarity ("although the script is
  clumsy , ...") so that a label is not one word away.
* ``ag_news/train.csv``, ``ag_news/test.csv``: the published AG News layout
  (no header, ``"class index","title","description"``, all fields quoted,
  classes 1..4 = World, Sports, Business, Sci/Tech), balanced; wire-service
  tags, quoted speech (doubled quotes) and the original's ``#39;`` / ``#36;``
  entity artefacts appear as in the real files.
* ``bpe/vocab.json`` + ``bpe/merges.txt``: GPT-2-format byte-level BPE
  trained on both train splits' texts (`tasks.textcls.EXTRA_TOKENS`, SEP and
  the label tokens, are not in it: the task vocabulary appends them).
* ``README.md`` with statistics.

All films, people, places, teams and companies are invented.

``python -m tasks.textcls_sample.generate --public_corpus`` (optionally
``--output_dir``) instead writes the unlabelled *public* pretraining corpus
``tasks/data/textcls_public/`` (`generate_public_corpus`): reviews and news
items from the same templates, with entity pools (`PUBLIC_POOLS`) that share
no word with the sample's (`SAMPLE_POOLS`), rendered as the task's text.

Determinism: one ``random.Random`` per file from fixed seeds, only ordered
containers; BPE is trained on a fixed list of texts. Needs the standard
library, ``tokenizers`` and the (pure Python) `tasks.textcls` readers; no
TensorFlow.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import io
import os
import random
import re

from dpjax.data.readers import text_corpus, textcls
from tasks.semparse_sample.generate import train_bpe

SEEDS = {("sst2", "train"): 9201, ("sst2", "test"): 9202,
         ("ag_news", "train"): 9301, ("ag_news", "test"): 9302}
SIZES = {"train": 800, "test": 200}  # examples per file, balanced over classes
BPE_VOCAB_SIZE = 1500  # at most, including <|endoftext|>
DEFAULT_OUTPUT_DIR = textcls.SAMPLE_DIR
PUBLIC_SEED = 9401
DEFAULT_PUBLIC_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "textcls_public")
# Public documents per dataset (before the train / validation split),
# balanced over the classes; every PUBLIC_VALIDATION_EVERY-th document of the
# shuffled corpus is validation.
PUBLIC_SIZES = {"sst2": 5000, "ag_news": 3600}
PUBLIC_VALIDATION_EVERY = 20

# ---------------------------------------------------------------------------
# SST-2: movie-review sentences.
# ---------------------------------------------------------------------------

_FILMS = ("the lantern keeper", "northbound", "a quiet harvest", "glass orchards",
          "the tin admiral", "marrow lane", "ember and ash", "the long thaw",
          "paper moons", "saltwater kings", "the ninth bell", "copperhead summer",
          "the cartographer 's daughter", "low tide", "winter of the fox")
_DIRECTORS = ("vesna hartwell", "oriel brisby", "casimir dunmore", "tamsin ellery",
              "joran kettering", "mirela oakhurst", "soren galloway", "petra norcott")
_GENRES = ("film", "movie", "comedy", "drama", "thriller", "documentary", "romance",
           "picture", "melodrama", "satire", "western", "musical")
_ASPECTS = (("the performances", "are"), ("the script", "is"), ("the direction", "is"),
            ("the cinematography", "is"), ("the dialogue", "is"), ("the soundtrack", "is"),
            ("the pacing", "is"), ("the ending", "is"), ("the cast", "is"),
            ("the editing", "is"), ("the plot", "is"), ("the jokes", "are"),
            ("the characters", "are"), ("the visuals", "are"))
_ADJ = {1: ("gorgeous", "witty", "moving", "delightful", "sharp", "heartfelt", "luminous",
            "clever", "tender", "exhilarating", "funny", "smart", "beautifully crafted",
            "wonderfully acted", "engrossing", "charming", "poignant", "inventive",
            "assured", "rich", "warm", "thrilling"),
        0: ("dull", "tedious", "clumsy", "lifeless", "shallow", "overlong", "predictable",
            "flat", "tiresome", "incoherent", "bland", "pretentious", "sloppy",
            "forgettable", "mean-spirited", "joyless", "stale", "murky", "hollow",
            "grating", "lazy", "cheap")}
_VERB_PHRASES = {
    1: ("rewards your patience", "earns every laugh", "stays with you long after the credits",
        "finds the heart in small moments", "never misses a beat",
        "makes the familiar feel new", "is worth seeing twice", "lifts the genre",
        "holds you from the first frame", "sparkles with life", "knows exactly what it wants"),
    0: ("wastes a fine cast", "never finds its footing", "drags on far too long",
        "falls apart in the last act", "feels like a chore", "has nothing new to say",
        "squanders its premise", "runs out of ideas early", "left me checking my watch",
        "goes nowhere", "mistakes noise for wit")}
_NOUNS = {1: ("a triumph", "a small gem", "a joy", "a treat", "a winner", "a knockout",
              "a genuine pleasure", "a must-see"),
          0: ("a mess", "a misfire", "a slog", "a letdown", "a dud", "a chore",
              "a disappointment", "a waste of time")}
_INTENSIFIERS = ("", "", "", "truly ", "quite ", "very ", "surprisingly ", "remarkably ",
                 "utterly ")


def _sst2_sentence(rng: random.Random, label: int, pools: EntityPools | None = None
                   ) -> str:
  pools = pools or SAMPLE_POOLS
  pick = rng.choice
  other = 1 - label
  adj, vp, noun = _ADJ[label], _VERB_PHRASES[label], _NOUNS[label]
  aspect, be = pick(_ASPECTS)
  aspect2, be2 = pick(_ASPECTS)
  a, b, c = rng.sample(adj, 3)
  forms = (
      lambda: f"{pick(pools.films)} is {pick(_INTENSIFIERS)}{a} .",
      lambda: f"{aspect} {be} {a} and {b}",
      lambda: f"{pick(pools.directors)} 's {pick(_GENRES)} {pick(vp)} .",
      lambda: f"it 's {pick(noun)} .",
      lambda: f"although {aspect} {be} {pick(_ADJ[other])} , the {pick(_GENRES)} {pick(vp)} .",
      lambda: f"{a} , {b} and {c} .",
      lambda: f"a {pick(_INTENSIFIERS)}{a} {pick(_GENRES)} that {pick(vp)}",
      lambda: f"the {pick(_GENRES)} is n't {pick(_ADJ[other])} ; it 's {a} .",
      lambda: f"{aspect} {be} {a} , but {aspect2} {be2} even more {b} .",
      lambda: f"not since {pick(pools.films)} has a {pick(_GENRES)} been this {a} .",
      lambda: f"{a}",
      lambda: f"{pick(pools.films)} {pick(vp)} , and {aspect} {be} {pick(_INTENSIFIERS)}{b} .",
  )
  return pick(forms)()


# ---------------------------------------------------------------------------
# AG News: wire stories of four topics.
# ---------------------------------------------------------------------------

_COUNTRIES = ("Veloria", "Castrana", "Norvask", "Ithmar", "Belcoria", "Tamaran",
              "Oskovia", "Duravel", "Quessa", "the Pell Islands")
_CITIES = ("VELPORT", "CASTRA CITY", "NORHOLM", "ITHMAR BAY", "BELGROVE", "TAMAR",
           "OSKOV", "DURAVEL", "QUESSA", "PELL HARBOUR")
_PEOPLE = ("Arvel Vantrell", "Bretta Calloway", "Corin Farrow", "Dalia Jessup",
           "Edrin Larkspur", "Fenna Pembrook", "Garrick Isley", "Hesper Merriweather",
           "Ilsa Norcott", "Quill Hartwell", "Rosalind Brisby", "Ulric Ellery")
_OFFICIALS = ("prime minister", "foreign minister", "president", "defence minister",
              "interior minister", "opposition leader")
_ISSUES = ("border dispute", "ceasefire", "refugee crisis", "trade embargo",
           "nuclear talks", "disputed election", "peace accord", "flood relief effort",
           "opposition protests", "hostage crisis")
_TEAMS = ("Velport Mariners", "Castra Rovers", "Norholm Wolves", "Belgrove United",
          "Tamar Falcons", "Ithmar Comets", "Quessa Hornets", "Duravel Kings")
_EVENTS = ("Open", "Grand Prix", "championship", "cup final", "marathon", "masters")
_COMPANIES = ("Halvard Motors", "Brightwell Foods", "Corvane Energy", "Fenwick Bank",
              "Marlow Retail", "Osric Airlines", "Pellham Steel", "Quarry Mining Corp.")
_TECH = ("Lumisoft", "Qubitron", "Nebulink", "Datavane", "Orbis Labs", "Pixelforge",
         "Synaptica")
_PRODUCTS = ("search engine", "smartphone", "operating system", "web browser", "chip",
             "music player", "laptop", "game console", "spam filter")
_SCIENCE = ("a new species of frog", "water ice on a distant moon", "a gene linked to ageing",
            "the oldest known star map", "a comet with two tails", "a faster way to sort data")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_QUARTERS = ("first-quarter", "second-quarter", "third-quarter", "fourth-quarter")
_SOURCES = ("Reuters", "AP", "AFP")


@dataclasses.dataclass(frozen=True)
class EntityPools:
  """The named entities the templates draw from (films and directors are
  lower-cased and tokenized as in SST-2; cities are upper-cased datelines)."""
  films: tuple[str, ...]
  directors: tuple[str, ...]
  countries: tuple[str, ...]
  cities: tuple[str, ...]
  people: tuple[str, ...]
  teams: tuple[str, ...]
  companies: tuple[str, ...]
  tech: tuple[str, ...]

  def words(self) -> list[str]:
    """The lower-cased alphanumeric words of every entry, in pool order."""
    return [w for f in dataclasses.fields(self) for entry in getattr(self, f.name)
            for w in re.findall(r"[a-z0-9]+", entry.lower())]


SAMPLE_POOLS = EntityPools(_FILMS, _DIRECTORS, _COUNTRIES, _CITIES, _PEOPLE, _TEAMS,
                           _COMPANIES, _TECH)

# The public corpus' entities: invented, and sharing no word with
# SAMPLE_POOLS but the function words below (checked by
# `check_public_pools`, called by `generate_public_corpus`).
PUBLIC_POOLS = EntityPools(
    films=("the clockmaker 's son", "driftwood", "a borrowed season", "the silver meadow",
           "crooked river", "the amber lighthouse", "ravensmere", "the last ferry",
           "the iron bride", "autumn crossing", "a field of sparrows", "the brass canary",
           "midnight at the depot", "stone and feather", "velvet thunder",
           "the weaver 's song", "the hundredth morning", "blue hour",
           "the fisherman 's widow", "kestrel point"),
    directors=("rafe ashcombe", "delphine korver", "matthias quint", "saskia vanderholt",
               "lucan fairweather", "annika stroud", "bastien morrow", "ottilie renwick",
               "teodor blakemere", "imogen thistlewood", "kasimir lindqvist",
               "noor halberd"),
    countries=("Sarvenia", "Drovania", "Estmark", "Luvonia", "Perravia", "Kelmora",
               "Varnholt", "Zemaria", "Auridon", "Brenmoor", "Talvesta",
               "the Korral Isles"),
    cities=("SARVEN", "DROVA", "ESTHAVEN", "LUVON", "PERRA", "KELMOR", "VARNPORT", "ZEMAR",
            "PORT ELSWICK", "KORRAL SOUND", "NEW TARRIN", "BRENMOOR"),
    people=("Alaric Dunstable", "Beatrix Holloway", "Cassius Whitlock", "Delia Marchbank",
            "Emeric Stonebridge", "Freya Ashdown", "Gideon Tallis", "Honora Pike",
            "Ivo Brandreth", "Juno Carraway", "Kit Lovell", "Leopold Vance", "Maren Oakes",
            "Nils Grantham", "Odile Featherstone", "Pascal Wrenfield", "Rhea Castellan",
            "Silas Thornbury", "Tobias Fenmore", "Una Blackwood", "Wilhelmina Crane",
            "Xavier Dallow", "Yara Kestwick", "Zeno Pritchard"),
    teams=("Sarven Harriers", "Drova Stags", "Esthaven Athletic", "Luvon Pilots",
           "Perra Lancers", "Kelmor Bears", "Varnport Sailors", "Zemar Rangers",
           "Elswick Town", "Korral Sharks", "Tarrin Giants", "Brenmoor Owls"),
    companies=("Ashgrove Holdings", "Bellamy Insurance", "Carrick Chemicals",
               "Dunstan Shipping", "Everly Telecom", "Fairholt Breweries",
               "Glenmark Pharmaceuticals", "Harrowgate Textiles", "Ironvale Construction",
               "Kinsley Media", "Whitcombe Railways", "Tessaly Group"),
    tech=("Cloudwick", "Vectorial", "Hexaline", "Bytewave", "Quantelle", "Streamlet",
          "Cipherworks", "Novaspark", "Gridmind", "Tesserion"))
# Words both pools may hold: function words of titles and names.
SHARED_POOL_WORDS = ("the", "a", "and", "of", "s")


def check_public_pools(public: EntityPools = PUBLIC_POOLS,
                       sample: EntityPools = SAMPLE_POOLS) -> None:
  """Raises ValueError if a word of `public`'s entries, other than
  `SHARED_POOL_WORDS`, is a word of `sample`'s (case-insensitive)."""
  private = set(sample.words()) - set(SHARED_POOL_WORDS)
  shared = [w for w in public.words() if w in private]
  if shared:
    raise ValueError(f"public entity pools share words with the sample's: {shared}")


def _world(rng, pools):
  pick = rng.choice
  country, other = rng.sample(pools.countries, 2)
  official, person, issue = pick(_OFFICIALS), pick(pools.people), pick(_ISSUES)
  title = pick((f"{country.removeprefix('the ').title()} and {other} agree on {issue}",
                f"{country.removeprefix('the ').title()} {official} quits over {issue}",
                f"Protests grow in {pick(pools.cities).title()} over {issue}",
                f"UN urges calm as {issue} deepens"))
  body = pick((f"{country}'s {official} {person} said on {pick(_WEEKDAYS)} that talks on "
               f"the {issue} with {other} would resume next week.",
               f"Thousands marched through the capital of {country} on {pick(_WEEKDAYS)} "
               f"as the {issue} entered its {pick(('second', 'third', 'fifth'))} week.",
               f"\"We will not give up,\" {person}, {country}'s {official}, told reporters "
               f"after the {issue} talks with {other} broke down."))
  return title, body


def _sports(rng, pools):
  pick = rng.choice
  team, other = rng.sample(pools.teams, 2)
  person = pick(pools.people)
  a = rng.randint(1, 5)
  b = rng.randint(0, a - 1)
  title = pick((f"{team} beat {other} {a}-{b}", f"{person} leads {team} past {other}",
                f"{team} sign striker {person}", f"{person} wins {pick(_EVENTS)} title"))
  body = pick((f"{person} scored twice in the second half as the {team} beat the {other} "
               f"{a}-{b} on {pick(_WEEKDAYS)} night to move top of the league.",
               f"The {team} extended their unbeaten run to {rng.randint(4, 15)} games with "
               f"a {a}-{b} win over the {other}, their coach said.",
               f"{person} won the {pick(_EVENTS)} on {pick(_WEEKDAYS)}, finishing "
               f"{rng.randint(2, 40)} seconds ahead of the defending champion."))
  return title, body


def _business(rng, pools):
  pick = rng.choice
  company, other = rng.sample(pools.companies, 2)
  pct = rng.randint(2, 40)
  title = pick((f"{company} profit rises {pct} percent",
                f"{company} shares fall on weak outlook",
                f"{company} to cut {rng.randint(2, 90) * 100} jobs",
                f"Oil prices climb above #36;{rng.randint(40, 60)} a barrel",
                f"{company} agrees to buy {other}"))
  body = pick((f"{company} said on {pick(_WEEKDAYS)} its {pick(_QUARTERS)} profit rose "
               f"{pct} percent, helped by strong sales, and raised its forecast.",
               f"Shares of {company} fell {rng.randint(2, 15)} percent after the company "
               f"warned that higher costs would hurt earnings this year.",
               f"{company} agreed to buy {other} for about #36;{rng.randint(2, 90)} "
               f"billion in cash and stock, the companies said."))
  return title, body


def _scitech(rng, pools):
  pick = rng.choice
  company, product = pick(pools.tech), pick(_PRODUCTS)
  title = pick((f"{company} unveils new {product}", f"Scientists find {pick(_SCIENCE)}",
                f"{company} patches security flaw in {product}",
                f"Space probe sends back images of {pick(('Mars', 'Saturn', 'a comet'))}",
                f"{company} #39;s {product} gains users"))
  body = pick((f"{company} on {pick(_WEEKDAYS)} released a new version of its {product}, "
               "promising faster performance and better security.",
               f"Researchers said they had found {pick(_SCIENCE)}, a result that could "
               "change how the field models the early universe.",
               f"A flaw in {company}'s {product} could let attackers take over a computer, "
               "security experts warned, urging users to update their software."))
  return title, body


_TOPICS = (_world, _sports, _business, _scitech)  # label order of LABELS["ag_news"]


def _ag_news_story(rng: random.Random, label: int, pools: EntityPools | None = None
                   ) -> tuple[str, str]:
  pools = pools or SAMPLE_POOLS
  title, body = _TOPICS[label](rng, pools)
  source = rng.choice(_SOURCES)
  if rng.random() < 0.5:
    body = f"{rng.choice(pools.cities)} ({source}) - {body}"
  elif rng.random() < 0.5:
    body = f"{source} - {body}"
  if rng.random() < 0.3:
    title = f"{title} ({source})"
  return title, body


# ---------------------------------------------------------------------------
# Files.
# ---------------------------------------------------------------------------


def _labels(rng: random.Random, dataset: str, split: str) -> list[int]:
  num_classes = len(textcls.LABELS[dataset])
  labels = [i % num_classes for i in range(SIZES[split])]
  rng.shuffle(labels)
  return labels


def _item(rng: random.Random, dataset: str, label: int, pools: EntityPools):
  """One SST-2 sentence, or one AG News (title, description)."""
  if dataset == "sst2":
    return _sst2_sentence(rng, label, pools)
  return _ag_news_story(rng, label, pools)


def sample_items(dataset: str, split: str):
  """Yields (label, item) of one sample file, in file order (see `_item`)."""
  rng = random.Random(SEEDS[(dataset, split)])
  for label in _labels(rng, dataset, split):
    yield label, _item(rng, dataset, label, SAMPLE_POOLS)


def render(dataset: str, item) -> str:
  """The text the task reads for an item (`dpjax.data.readers.textcls`: SST-2's
  sentence, AG News' `title + " " + description`, whitespace runs as one
  space), without any label or separator token."""
  if dataset == "sst2":
    return textcls.clean_text(item)
  title, description = item
  return textcls.clean_text(title + " " + description)


def build(dataset: str, split: str) -> str:
  """The text of one file."""
  buf = io.StringIO()
  if dataset == "sst2":
    buf.write("sentence\tlabel\n")
    for label, sentence in sample_items(dataset, split):
      buf.write(f"{sentence} \t{label}\n")
  else:
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for label, story in sample_items(dataset, split):
      writer.writerow((label + 1, *story))
  return buf.getvalue()


def _readme(output_dir: str, loaded: dict) -> str:
  import tokenizers  # pylint: disable=g-import-not-at-top

  tok = tokenizers.ByteLevelBPETokenizer(os.path.join(output_dir, "bpe", "vocab.json"),
                                         os.path.join(output_dir, "bpe", "merges.txt"))
  rows = ["# textcls_sample", "",
          "Fictional SST-2 (GLUE TSV) and AG News (published CSV) samples generated",
          "by `python -m tasks.textcls_sample.generate` (deterministic; do not edit",
          "by hand). Read them with `tasks.textcls.load_examples`. `bpe/` is a",
          "byte-level BPE trained on both train splits' texts (the task vocabulary",
          "appends `tasks.textcls.EXTRA_TOKENS`).", "",
          "| statistic | value |", "| --- | --- |"]
  for (dataset, split), examples in loaded.items():
    counts = collections.Counter(e.label for e in examples)
    lengths = [len(e.ids) for e in tok.encode_batch([e.text for e in examples])]
    rows.append(f"| {dataset} {split} ({textcls.SPLIT_FILES[dataset][split]}): examples "
                f"per class | " + ", ".join(f"{textcls.LABELS[dataset][c]} {counts[c]}"
                                            for c in sorted(counts)) + " |")
    rows.append(f"| {dataset} {split}: BPE tokens per text, mean / max | "
                f"{sum(lengths) / len(lengths):.1f} / {max(lengths)} |")
  rows.append(f"| BPE vocabulary (without the extra tokens) | {tok.get_vocab_size()} |")
  return "\n".join(rows) + "\n"


def generate(output_dir: str = DEFAULT_OUTPUT_DIR, *, train_vocabulary: bool = True
             ) -> dict[tuple[str, str], list[textcls.Example]]:
  """Writes the samples under `output_dir`; returns {(dataset, split):
  examples} as `tasks.textcls` reads them back."""
  loaded = {}
  for dataset in textcls.DATASETS:
    directory = os.path.join(output_dir, os.path.basename(textcls.DEFAULT_DATA_DIRS[dataset]))
    os.makedirs(directory, exist_ok=True)
    for split in textcls.SPLITS:
      with open(os.path.join(directory, textcls.SPLIT_FILES[dataset][split]), "w",
                encoding="utf-8", newline="") as f:
        f.write(build(dataset, split))
      loaded[(dataset, split)] = textcls.load_examples(dataset, split, directory)
  if train_vocabulary:
    bpe_dir = os.path.join(output_dir, "bpe")
    os.makedirs(bpe_dir, exist_ok=True)
    train_bpe([e.text for d in textcls.DATASETS for e in loaded[(d, "train")]], bpe_dir,
              vocab_size=BPE_VOCAB_SIZE)
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8",
              newline="\n") as f:
      f.write(_readme(output_dir, loaded))
  return loaded


# ---------------------------------------------------------------------------
# Public pretraining corpus.
# ---------------------------------------------------------------------------


def public_documents(seed: int = PUBLIC_SEED) -> list[tuple[str, int, str]]:
  """The public corpus' documents as (dataset, label, text), in corpus order.

  `PUBLIC_SIZES[dataset]` items per dataset, balanced over its classes, from
  the sample's templates with `PUBLIC_POOLS`, rendered by `render`. A text
  already drawn, or equal to a text of the private sample (any dataset or
  split), is redrawn, so documents are unique and none is a private text.
  """
  check_public_pools()
  private = {render(d, item) for d in textcls.DATASETS for s in textcls.SPLITS
             for _, item in sample_items(d, s)}
  rng = random.Random(seed)
  seen: set[str] = set()
  docs = []
  for dataset in textcls.DATASETS:
    num_classes = len(textcls.LABELS[dataset])
    labels = [i % num_classes for i in range(PUBLIC_SIZES[dataset])]
    rng.shuffle(labels)
    for label in labels:
      for _ in range(1000):
        text = render(dataset, _item(rng, dataset, label, PUBLIC_POOLS))
        if text not in seen and text not in private:
          break
      else:
        raise RuntimeError(f"no new {dataset} text of class {label} in 1000 draws")
      seen.add(text)
      docs.append((dataset, label, text))
  rng.shuffle(docs)
  return docs


def _split_stats(texts: list[str]) -> dict[str, int]:
  return {"documents": len(texts), "words": sum(len(t.split()) for t in texts),
          "characters": sum(len(t) for t in texts)}


def _tokens_per_word(tok, texts: list[str]) -> float:
  tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
  return round(tokens / sum(len(t.split()) for t in texts), 3)


def _public_readme(stats: dict, counts: dict) -> str:
  rows = ["# textcls_public", "",
          "Unlabelled public pretraining corpus for the textcls world (SST-2-style",
          "movie-review sentences and AG News-style news items), generated by",
          "`python -m tasks.textcls_sample.generate --public_corpus` (deterministic,",
          f"`PUBLIC_SEED = {PUBLIC_SEED}`; do not edit by hand).", "",
          "`train.jsonl` / `validation.jsonl`: one `{\"text\": document}` per line; a",
          "document is one review sentence or one news item, rendered exactly as",
          "`tasks.textcls` reads a private example's text (SST-2: the lower-cased,",
          "tokenized sentence; AG News: `title + \" \" + description`, with the",
          "`#39;` / `#36;` artefacts), with no label, separator or other extra token:",
          "every document encodes with `textcls_sample/bpe/` as it is. Classes are",
          "balanced but not emitted; documents are shuffled (the two styles mixed),",
          "every 20th is validation.", "",
          "| statistic | train | validation |", "| --- | --- | --- |"]
  for key in ("documents", "words", "characters"):
    rows.append(f"| {key} | {stats['train'][key]} | {stats['validation'][key]} |")
  for dataset in textcls.DATASETS:
    rows.append(f"| {dataset}-style documents | {counts['train'][dataset]} | "
                f"{counts['validation'][dataset]} |")
  rows += ["", "Documents per class (both splits; not in the files): " + "; ".join(
      ", ".join(f"{textcls.LABELS[d][c]} {stats['classes'][d][c]}"
                for c in range(len(textcls.LABELS[d]))) for d in textcls.DATASETS) + ".",
           "", "BPE tokens per whitespace word with `textcls_sample/bpe/` (byte-level:",
           "nothing is unknown): public train "
           f"{stats['bpe_tokens_per_word']['public_train']}, private sample train "
           f"{stats['bpe_tokens_per_word']['private_train']}.",
           "The BPE was trained on the private text, so the public names split into",
           "more pieces.", "",
           "Disjoint from the private sample (`tasks/data/textcls_sample/`): the",
           "entities (films, directors, countries, cities, people, teams, companies,",
           "tech firms) come from `PUBLIC_POOLS`, whose entries share no word with the",
           "sample's `SAMPLE_POOLS` other than \"the\", \"a\", \"and\", \"of\", \"'s\"",
           "(`check_public_pools` raises otherwise); no document equals a private",
           "text, and documents are unique (so train and validation are disjoint).",
           "`tests/textcls/test_textcls_public_corpus.py` checks this against the",
           "committed private files: no word that occurs there only inside a sample",
           "pool entity occurs in this corpus, and no document is a private text.",
           "Template words (genres, adjectives, weekdays, wire-service tags",
           "Reuters / AP / AFP, Mars / Saturn) are shared by design."]
  return "\n".join(rows) + "\n"


def generate_public_corpus(output_dir: str = DEFAULT_PUBLIC_DIR, *, seed: int = PUBLIC_SEED
                           ) -> dict:
  """Writes the public corpus (`train.jsonl`, `validation.jsonl`,
  `README.md`) under `output_dir`; returns its statistics."""
  import tokenizers  # pylint: disable=g-import-not-at-top

  docs = public_documents(seed)
  splits = {"train": [], "validation": []}
  for i, doc in enumerate(docs):
    splits["validation" if i % PUBLIC_VALIDATION_EVERY == 0 else "train"].append(doc)
  os.makedirs(output_dir, exist_ok=True)
  for split, split_docs in splits.items():
    text_corpus.write_documents(os.path.join(output_dir, f"{split}.jsonl"),
                                [text for _, _, text in split_docs])
  tok = tokenizers.ByteLevelBPETokenizer(textcls.DEFAULT_BPE_VOCAB_PATH,
                                         textcls.DEFAULT_BPE_MERGES_PATH)
  private_train = [render(d, item) for d in textcls.DATASETS
                   for _, item in sample_items(d, "train")]
  stats = {split: _split_stats([t for _, _, t in split_docs])
           for split, split_docs in splits.items()}
  stats["classes"] = {d: [sum(1 for dd, label, _ in docs if dd == d and label == c)
                          for c in range(len(textcls.LABELS[d]))] for d in textcls.DATASETS}
  stats["bpe_tokens_per_word"] = {
      "public_train": _tokens_per_word(tok, [t for _, _, t in splits["train"]]),
      "private_train": _tokens_per_word(tok, private_train)}
  counts = {split: {d: sum(1 for dd, _, _ in split_docs if dd == d) for d in textcls.DATASETS}
            for split, split_docs in splits.items()}
  stats["documents_per_dataset"] = counts
  with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8",
            newline="\n") as f:
    f.write(_public_readme(stats, counts))
  return stats


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=None,
                      help=f"default {DEFAULT_OUTPUT_DIR}, or {DEFAULT_PUBLIC_DIR} with "
                      "--public_corpus")
  parser.add_argument("--no_vocab", action="store_true",
                      help="skip training the BPE vocabulary (and the README)")
  parser.add_argument("--public_corpus", action="store_true",
                      help="write the unlabelled public pretraining corpus instead of the "
                      "sample")
  args = parser.parse_args(argv)
  if args.public_corpus:
    output_dir = args.output_dir or DEFAULT_PUBLIC_DIR
    generate_public_corpus(output_dir)
  else:
    output_dir = args.output_dir or DEFAULT_OUTPUT_DIR
    generate(output_dir, train_vocabulary=not args.no_vocab)
  path = os.path.join(output_dir, "README.md")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      print(f.read())


if __name__ == "__main__":
  main()
