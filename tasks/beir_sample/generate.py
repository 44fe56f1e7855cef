"""Deterministic generator of a tiny BEIR-format dataset about invented lighthouses.

Run ``python -m tasks.beir_sample.generate`` (optionally ``--output_dir``) to
(re)create ``tasks/data/beir_sample/`` in the layout of the BEIR benchmark
(Thakur et al., 2021), the paper's zero-shot evaluation format:

* ``corpus.jsonl``     ``{"_id", "title", "text"}`` per line
* ``queries.jsonl``    ``{"_id", "text"}`` per line
* ``qrels/test.tsv``   header ``query-id  corpus-id  score``, then graded
  judgements: 2 for the lighthouse's own page, 1 for the survey of its
  coast (which names it), 0 for a page judged not relevant
* ``README.md``        statistics

Every lighthouse page describes one invented lighthouse; each coast survey
lists the lighthouses of its coast; the logbook pages are distractors (no
query is about them, and their title is empty). Every query asks about one
attribute of one lighthouse by its unique name. Some names are not ASCII.
Made with ``random.Random(SEED)`` and ordered containers only, so the output
is byte-for-byte reproducible; standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import random

SEED = 20240611
DEFAULT_OUTPUT_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "beir_sample")

NUM_LIGHTHOUSES = 40
NUM_QUERIES = 30  # about the first 30 lighthouses
NUM_LOGBOOKS = 10

_PREFIXES = ("Skær", "Brann", "Holm", "Kyst", "Mørk", "Vind", "Salt", "Grå",
             "Stor", "Lille", "Fjell", "Sand", "Stein", "Bølge")
_SUFFIXES = ("vik", "nes", "øy", "holmen", "odden", "skjær", "fjord", "berg",
             "sund", "voll")
_COASTS = ("Amber Coast", "Iron Coast", "Gull Coast", "Fog Coast", "Reed Coast",
           "Whale Coast")
_COLOURS = ("white", "red", "green", "amber", "blue", "violet")
_KEEPERS = ("Ingrid Falk", "Tobias Lund", "Maren Holt", "Eskil Varg", "Sigrid Moe",
            "Anders Brekk", "Hedda Strand", "Oskar Lie", "Tuva Ness", "Ragnar Dahl")
_MATERIALS = ("granite", "red brick", "cast iron", "whitewashed stone", "timber")

# Query templates per attribute: (question, attribute key).
_QUESTIONS = (
    ("how tall is the {name} lighthouse", "height"),
    ("when was {name} lighthouse built", "year"),
    ("what colour is the light of {name}", "colour"),
    ("who kept the {name} lighthouse", "keeper"),
    ("what is {name} lighthouse made of", "material"),
)


def _lighthouses(rng: random.Random) -> list[dict]:
  names = [p + s for p in _PREFIXES for s in _SUFFIXES]
  rng.shuffle(names)
  return [{
      "id": f"lh-{i:04d}", "name": names[i], "coast": rng.choice(_COASTS),
      "height": rng.randrange(12, 60), "year": rng.randrange(1790, 1920),
      "colour": rng.choice(_COLOURS), "keeper": rng.choice(_KEEPERS),
      "material": rng.choice(_MATERIALS),
  } for i in range(NUM_LIGHTHOUSES)]


def _page(h: dict) -> dict:
  return {"_id": h["id"], "title": f"{h['name']} Lighthouse", "text": (
      f"{h['name']} lighthouse stands on the {h['coast']}. It was built in "
      f"{h['year']} of {h['material']} and rises {h['height']} metres above the "
      f"rocks. Its {h['colour']} light can be seen far out at sea. For many "
      f"years it was kept by {h['keeper']}.")}


def _survey(index: int, coast: str, names: list[str]) -> dict:
  return {"_id": f"survey-{index:02d}", "title": f"Survey of the {coast}", "text": (
      f"The survey of the {coast} counts {len(names)} lighthouses: "
      f"{', '.join(names)}. Ships are warned to keep clear of the reefs.")}


def _logbook(index: int, rng: random.Random) -> dict:
  wind = rng.choice(("north", "south", "east", "west"))
  return {"_id": f"log-{index:02d}", "title": "", "text": (
      f"Logbook entry {index + 1}: wind from the {wind}"
      f", {rng.randrange(2, 9)} boats sighted, the lamp was trimmed at "
      f"{rng.randrange(17, 23)} o'clock and the fog bell rang twice.")}


def generate(output_dir: str = DEFAULT_OUTPUT_DIR, seed: int = SEED) -> None:
  rng = random.Random(seed)
  houses = _lighthouses(rng)
  coasts = [c for c in _COASTS if any(h["coast"] == c for h in houses)]
  survey_of = {c: f"survey-{i:02d}" for i, c in enumerate(coasts)}
  corpus = [_page(h) for h in houses]
  corpus += [_survey(i, c, [h["name"] for h in houses if h["coast"] == c])
             for i, c in enumerate(coasts)]
  corpus += [_logbook(i, rng) for i in range(NUM_LOGBOOKS)]
  rng.shuffle(corpus)  # the file order is not the id order

  queries, qrels = [], []
  for i, h in enumerate(houses[:NUM_QUERIES]):
    question, _ = _QUESTIONS[rng.randrange(len(_QUESTIONS))]
    qid = f"q{i + 1:03d}"
    queries.append({"_id": qid, "text": question.format(name=h["name"])})
    qrels.append((qid, h["id"], 2))
    qrels.append((qid, survey_of[h["coast"]], 1))
    if i % 5 == 0:  # a page judged and found not relevant
      qrels.append((qid, houses[(i + 1) % NUM_LIGHTHOUSES]["id"], 0))

  os.makedirs(os.path.join(output_dir, "qrels"), exist_ok=True)

  def write(name: str, lines: list[str]) -> None:
    with open(os.path.join(output_dir, name), "w", encoding="utf-8", newline="\n") as f:
      f.writelines(line + "\n" for line in lines)

  write("corpus.jsonl", [json.dumps(d, ensure_ascii=False) for d in corpus])
  write("queries.jsonl", [json.dumps(q, ensure_ascii=False) for q in queries])
  write(os.path.join("qrels", "test.tsv"),
        ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{s}" for q, d, s in qrels])
  write("README.md", [
      "# beir_sample", "",
      "A tiny, fictional BEIR-format dataset generated by",
      "`python -m tasks.beir_sample.generate` (deterministic; do not edit by",
      "hand): `corpus.jsonl`, `queries.jsonl`, `qrels/test.tsv` (graded: 2 the",
      "lighthouse's page, 1 its coast's survey, 0 judged not relevant).", "",
      "| statistic | value |", "| --- | --- |",
      f"| documents | {len(corpus)} |",
      f"| lighthouse pages / coast surveys / logbooks | {len(houses)} / "
      f"{len(coasts)} / {NUM_LOGBOOKS} |",
      f"| queries | {len(queries)} |",
      f"| judgements (score 2 / 1 / 0) | {len(qrels)} "
      f"({sum(s == 2 for *_, s in qrels)} / {sum(s == 1 for *_, s in qrels)} / "
      f"{sum(s == 0 for *_, s in qrels)}) |",
  ])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR)
  parser.add_argument("--seed", type=int, default=SEED)
  args = parser.parse_args(argv)
  generate(args.output_dir, seed=args.seed)
  with open(os.path.join(args.output_dir, "README.md"), encoding="utf-8") as f:
    print(f.read())


if __name__ == "__main__":
  main()
