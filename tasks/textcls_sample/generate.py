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

Determinism: one ``random.Random`` per file from fixed seeds, only ordered
containers; BPE is trained on a fixed list of texts. Needs the standard
library, ``tokenizers`` and the (pure Python) `tasks.textcls` readers; no
TensorFlow.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import os
import random

from dpjax.datasets import textcls
from tasks.semparse_sample.generate import train_bpe

SEEDS = {("sst2", "train"): 9201, ("sst2", "test"): 9202,
         ("ag_news", "train"): 9301, ("ag_news", "test"): 9302}
SIZES = {"train": 800, "test": 200}  # examples per file, balanced over classes
BPE_VOCAB_SIZE = 1500  # at most, including <|endoftext|>
DEFAULT_OUTPUT_DIR = textcls.SAMPLE_DIR

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


def _sst2_sentence(rng: random.Random, label: int) -> str:
  pick = rng.choice
  other = 1 - label
  adj, vp, noun = _ADJ[label], _VERB_PHRASES[label], _NOUNS[label]
  aspect, be = pick(_ASPECTS)
  aspect2, be2 = pick(_ASPECTS)
  a, b, c = rng.sample(adj, 3)
  forms = (
      lambda: f"{pick(_FILMS)} is {pick(_INTENSIFIERS)}{a} .",
      lambda: f"{aspect} {be} {a} and {b}",
      lambda: f"{pick(_DIRECTORS)} 's {pick(_GENRES)} {pick(vp)} .",
      lambda: f"it 's {pick(noun)} .",
      lambda: f"although {aspect} {be} {pick(_ADJ[other])} , the {pick(_GENRES)} {pick(vp)} .",
      lambda: f"{a} , {b} and {c} .",
      lambda: f"a {pick(_INTENSIFIERS)}{a} {pick(_GENRES)} that {pick(vp)}",
      lambda: f"the {pick(_GENRES)} is n't {pick(_ADJ[other])} ; it 's {a} .",
      lambda: f"{aspect} {be} {a} , but {aspect2} {be2} even more {b} .",
      lambda: f"not since {pick(_FILMS)} has a {pick(_GENRES)} been this {a} .",
      lambda: f"{a}",
      lambda: f"{pick(_FILMS)} {pick(vp)} , and {aspect} {be} {pick(_INTENSIFIERS)}{b} .",
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


def _world(rng):
  pick = rng.choice
  country, other = rng.sample(_COUNTRIES, 2)
  official, person, issue = pick(_OFFICIALS), pick(_PEOPLE), pick(_ISSUES)
  title = pick((f"{country.removeprefix('the ').title()} and {other} agree on {issue}",
                f"{country.removeprefix('the ').title()} {official} quits over {issue}",
                f"Protests grow in {pick(_CITIES).title()} over {issue}",
                f"UN urges calm as {issue} deepens"))
  body = pick((f"{country}'s {official} {person} said on {pick(_WEEKDAYS)} that talks on "
               f"the {issue} with {other} would resume next week.",
               f"Thousands marched through the capital of {country} on {pick(_WEEKDAYS)} "
               f"as the {issue} entered its {pick(('second', 'third', 'fifth'))} week.",
               f"\"We will not give up,\" {person}, {country}'s {official}, told reporters "
               f"after the {issue} talks with {other} broke down."))
  return title, body


def _sports(rng):
  pick = rng.choice
  team, other = rng.sample(_TEAMS, 2)
  person = pick(_PEOPLE)
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


def _business(rng):
  pick = rng.choice
  company, other = rng.sample(_COMPANIES, 2)
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


def _scitech(rng):
  pick = rng.choice
  company, product = pick(_TECH), pick(_PRODUCTS)
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


def _ag_news_story(rng: random.Random, label: int) -> tuple[str, str]:
  title, body = _TOPICS[label](rng)
  source = rng.choice(_SOURCES)
  if rng.random() < 0.5:
    body = f"{rng.choice(_CITIES)} ({source}) - {body}"
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


def build(dataset: str, split: str) -> str:
  """The text of one file."""
  rng = random.Random(SEEDS[(dataset, split)])
  buf = io.StringIO()
  if dataset == "sst2":
    buf.write("sentence\tlabel\n")
    for label in _labels(rng, dataset, split):
      buf.write(f"{_sst2_sentence(rng, label)} \t{label}\n")
  else:
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for label in _labels(rng, dataset, split):
      writer.writerow((label + 1, *_ag_news_story(rng, label)))
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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR)
  parser.add_argument("--no_vocab", action="store_true",
                      help="skip training the BPE vocabulary (and the README)")
  args = parser.parse_args(argv)
  generate(args.output_dir, train_vocabulary=not args.no_vocab)
  path = os.path.join(args.output_dir, "README.md")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      print(f.read())


if __name__ == "__main__":
  main()
