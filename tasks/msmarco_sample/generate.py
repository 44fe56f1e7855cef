"""Deterministic generator of a small MSMARCO-format sample about a fictional world.

Run ``python -m tasks.msmarco_sample.generate`` (optionally ``--output_dir``) to
(re)create ``tasks/data/msmarco_sample/``:

* ``collection.tsv``     ``pid \\t passage``          (pids 0..N-1, like MSMARCO)
* ``queries.train.tsv``  ``qid \\t query``
* ``queries.dev.tsv``    ``qid \\t query``
* ``qrels.train.tsv``    ``qid \\t 0 \\t pid \\t 1``   (TREC qrels, MSMARCO layout)
* ``qrels.dev.tsv``      ``qid \\t 0 \\t pid \\t 1``
* ``spm/msmarco_sample.model`` / ``.vocab``: SentencePiece unigram model
  (vocab 2000) with T5's special ids: pad=0, eos=1, unk=2, no bos.
* ``README.md``: statistics of the generated sample.

Every passage describes exactly one invented entity (a town, person, animal,
plant, river, invention or dish) with several attributes, in 40-90 words of
templated English. Every query asks about one attribute of one entity, naming
it by its unique invented name, so it is answered by its own passage and by
no other. Dev queries are about entities distinct from the train ones, and the
collection also holds distractor passages that no query refers to.

The world is made with ``random.Random(SEED)`` and only ordered containers, so
the output is byte-for-byte reproducible; SentencePiece is trained with one
thread, a fixed input order, no sentence sampling/shuffling and a fixed seed.

``python -m tasks.msmarco_sample.generate --public_corpus`` (optionally
``--output_dir``, ``--seed``) writes instead the public pretraining corpus
``tasks/data/msmarco_public/`` (``generate_public_corpus``): the same world
for ``PUBLIC_SEED``, every invented word drawn outside the sample's words and
persons with other first names, one passage or query per line of
``train.jsonl`` / ``validation.jsonl`` (``{"text": ...}``), and a README.

This module needs only the standard library and ``sentencepiece`` (no
TensorFlow).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import string
from typing import Callable

from dpjax.data.readers import text_corpus

SEED = 20240517

DEFAULT_OUTPUT_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "data",
    "msmarco_sample",
)

# The public pretraining corpus (`generate_public_corpus`): the same world
# machinery for another seed, with every invented word drawn outside the
# sample's words and other first names.
PUBLIC_SEED = 918273
DEFAULT_PUBLIC_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "data",
    "msmarco_public",
)
PUBLIC_FILES = ("train.jsonl", "validation.jsonl")
PUBLIC_VALIDATION_FRACTION = 0.05

NUM_TRAIN_ENTITIES = 2600
NUM_DEV_ENTITIES = 260
NUM_DISTRACTOR_ENTITIES = 400
SECOND_QUERY_PROB = 0.15  # probability that an entity gets a 2nd query.
MIN_WORDS = 40
MAX_WORDS = 90

SPM_VOCAB_SIZE = 2000
SPM_SUBDIR = "spm"
SPM_MODEL_NAME = "msmarco_sample"
SPM_SEED = 1234
# Must equal tasks.msmarco.INPUT_PREFIX (checked by the tests); not imported
# from there to keep this script free of the task's dependencies.
TASK_INPUT_PREFIX = "generate_query: "

FILES = (
    "collection.tsv",
    "queries.train.tsv",
    "queries.dev.tsv",
    "qrels.train.tsv",
    "qrels.dev.tsv",
)

# ---------------------------------------------------------------------------
# Vocabulary of the fictional world.
# ---------------------------------------------------------------------------

_ONSETS = (
    "b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p",
    "r", "s", "st", "t", "th", "v", "w", "z", "sh", "tr", "qu", "j", "pl",
)
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ae", "ia", "ou", "y", "ei")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "m", "x", "nd", "rk", "st", "v")
_TOWN_SUFFIXES = ("", "", "", "", "ford", "holt", "wick", "mere", "dale", "mora",
                  "by", "stead", "ven", "port", "ton")

_FIRST_NAMES = (
    "Arvel", "Bretta", "Corin", "Dalia", "Edrin", "Fenna", "Garrick", "Hesper",
    "Ilsa", "Joran", "Kestra", "Lorne", "Mirela", "Nolan", "Oriel", "Petra",
    "Quill", "Rosalind", "Soren", "Tamsin", "Ulric", "Vesna", "Wendel", "Yara",
    "Zora", "Alder", "Briony", "Casimir", "Delphine", "Emeric", "Faye",
    "Gideon", "Hollis", "Isolde", "Jasper", "Linnea", "Matthias", "Nadira",
    "Osric", "Perrin", "Ramona", "Silas", "Thea", "Viggo", "Wilhelmina",
)
# First names of the public corpus's persons: none is a first name of the
# sample nor a word of it (checked by `generate_public_corpus`).
_PUBLIC_FIRST_NAMES = (
    "Anselm", "Beatrix", "Cedric", "Dorothea", "Elowen", "Florian", "Greta",
    "Horatio", "Ingrid", "Jules", "Katrin", "Leopold", "Marguerite", "Nikolai",
    "Ottilie", "Philippa", "Quentin", "Rosamund", "Sebastian", "Theodora",
    "Ursula", "Valentin", "Winifred", "Xavier", "Yvette", "Zeno", "Agatha",
    "Benedikt", "Clementine", "Dmitri", "Eleanor", "Frederick", "Gwendolyn",
    "Hugo", "Imogen", "Leander", "Magnus", "Nell", "Oswin", "Prudence",
    "Rupert", "Sabine", "Tobias", "Verena", "Wolfram",
)
_PROFESSIONS = (
    "cartographer", "glassblower", "astronomer", "poet", "shipwright",
    "botanist", "clockmaker", "physician", "composer", "stonemason",
    "weaver", "mathematician", "architect", "painter", "bookbinder",
    "engineer", "apothecary", "sculptor", "historian", "navigator",
    "brewer", "potter", "philosopher", "teacher", "surveyor", "luthier",
)
_WORK_NOUNS = (
    "Atlas", "Ledger", "Song", "Chronicle", "Map", "Treatise", "Garden",
    "Bridge", "Lantern", "Book", "Hymn", "Tower", "Almanac", "Portrait",
    "Survey", "Catalogue", "Fountain", "Sonnets", "Tapestry", "Compass",
)
_WORK_OF = (
    "Tides", "the Northern Hills", "Quiet Rivers", "Falling Stars", "the Salt Roads",
    "Lost Harbours", "the Seven Winds", "Winter Light", "the Old Orchards",
    "Copper Skies", "the Long Valley", "Green Marshes", "the Iron Coast",
    "Silver Rain", "the Hidden Lakes", "Amber Fields", "the Western Isles",
)
_EXPORTS = (
    "wool", "copper", "salted fish", "glass beads", "barley", "linen", "honey",
    "timber", "cheese", "river pearls", "dried figs", "slate", "rope", "cider",
    "pottery", "tin", "dyed silk", "walnuts", "leather boots", "candles",
    "paper", "olive oil", "iron nails", "smoked eels", "wax", "saffron",
    "marble", "woollen blankets", "clay pipes", "apples",
)
_LANDMARKS = (
    "a leaning clock tower", "a stone bridge of nine arches", "an old lighthouse",
    "a round market hall", "a ruined abbey", "a painted windmill",
    "a library built of red brick", "a fountain shaped like a heron",
    "a covered wooden bridge", "a bell foundry", "a walled herb garden",
    "an observatory on the hill", "a granary with a copper roof",
    "a canal lined with willows", "a hall of stained glass",
)
_ANIMAL_CLASSES = (
    "bird", "beetle", "frog", "lizard", "fish", "moth", "bat", "snail",
    "shrew", "butterfly", "salamander", "crab", "owl", "spider", "toad",
)
_ANIMAL_PREFIXES = (
    "marsh", "ridge", "copper", "dusky", "spotted", "lesser", "greater",
    "hooded", "striped", "pale", "crested", "banded", "northern", "southern",
    "long-tailed", "short-eared", "golden", "ash", "reed", "cave",
)
_COLOURS = (
    "bright green", "deep blue", "rust red", "pale yellow", "jet black",
    "silver grey", "dark brown", "orange", "violet", "olive", "white",
    "copper", "crimson", "sandy brown", "teal", "pink", "ochre", "slate grey",
)
_HABITATS = (
    "salt marshes", "pine forests", "dry grasslands",
    "limestone caves", "coastal cliffs", "reed beds", "oak woodlands",
    "alpine meadows", "sand dunes", "peat bogs", "river deltas",
    "birch forests", "desert canyons", "tropical swamps", "high plateaus",
    "old orchards", "heather moors",
)
_WATER_HABITATS = (
    "mountain streams", "river deltas", "rocky shores", "kelp forests",
    "salt marshes", "flooded meadows", "cold lakes", "tidal pools",
)
_DIETS = (
    "seeds", "insects", "snails", "small fish", "berries", "nectar",
    "fallen fruit", "worms", "algae", "moss", "spiders", "beetle larvae",
    "tree sap", "pollen", "water fleas",
)
_PLANT_KINDS = (
    "thistle", "lily", "vine", "rush", "bell", "clover", "orchid",
    "sedge", "poppy", "laurel", "sorrel", "briar", "mallow", "wort",
)
_PLANT_PREFIXES = (
    "creeping", "tall", "dwarf", "winter", "silver", "downy", "sweet",
    "bitter", "mountain", "shore", "meadow", "wild", "purple", "night",
)
_SEASONS = (
    "early spring", "late spring", "midsummer", "late summer", "early autumn",
    "late autumn", "the first weeks of winter", "the rainy season",
)
_PLANT_USES = (
    "making a yellow dye", "brewing a bitter tea", "treating coughs",
    "weaving baskets", "thatching roofs", "flavouring bread",
    "making rope fibre", "soothing burns", "feeding livestock",
    "scenting soap", "making ink", "stuffing mattresses", "curing headaches",
)
_SOILS = (
    "sandy soil", "wet clay", "chalky slopes", "acid peat", "rocky scree",
    "shaded riverbanks", "salty ground near the sea", "rich forest loam",
)
_INVENTION_WORDS = (
    "horn", "wheel", "loom", "lamp", "gauge", "scope", "press", "bell",
    "pump", "clock", "meter", "lens", "drum", "kettle", "sieve", "plough",
)
_MATERIALS = (
    "brass", "iron", "oak", "glass", "bronze", "copper", "silver", "steel",
    "walnut", "bone", "tin", "clay", "pewter", "cedar",
)
_PURPOSES = (
    "measure the speed of the wind", "measure the depth of wells",
    "spin wool into thread", "keep bread warm", "signal ships in fog",
    "weigh grain at markets", "tell the time at night", "pump water from mines",
    "sort seeds by size", "predict rain", "copy maps", "press grapes",
    "count sheep passing a gate", "light tunnels", "tune church bells",
    "cool cellars in summer", "measure the height of towers",
    "crack walnuts", "dry herbs", "carry messages between towers",
    "clean chimneys", "find north without a compass",
)
_DISH_KINDS = (
    "stew", "bread", "cakes", "pie", "soup", "dumplings", "porridge",
    "tart", "pudding", "flatbread", "sausage", "broth",
)
_INGREDIENTS = (
    "lentils", "smoked trout", "chestnuts", "goat cheese", "barley",
    "wild mushrooms", "turnips", "lamb", "duck eggs", "honey", "plums",
    "buckwheat", "sour cherries", "river crayfish", "leeks", "pumpkin",
    "rye flour", "pickled cabbage", "almonds", "beans",
)
_OCCASIONS = (
    "the harvest festival", "midwinter", "weddings", "the spring fair",
    "the first snowfall", "fishing season", "the new year",
    "the feast of lanterns", "market days", "funerals", "name days",
)
_METHODS = (
    "baked in a clay oven", "simmered for a whole day", "fried in butter",
    "steamed in cabbage leaves", "smoked over juniper", "roasted on hot stones",
    "boiled in salted water", "grilled over an open fire",
)
_TASTES = ("sweet", "sour", "smoky", "salty", "spicy", "mild", "bitter", "tangy")

_FILLERS = {
    "town": (
        "A weekly market is held in the main square.",
        "The streets are narrow and paved with grey cobblestones.",
        "Winters there are long, but the summers are warm.",
        "Many of the older houses have steep slate roofs.",
        "A small museum tells the story of the early settlers.",
        "Travellers often stop there on the way to the coast.",
        "The surrounding hills are covered with farms and orchards.",
    ),
    "person": (
        "Few letters from that period have survived.",
        "Contemporaries described a patient and stubborn character.",
        "Several students later continued the same work.",
        "A portrait of that time hangs in a provincial museum.",
        "Much of that life was spent travelling between cities.",
        "Historians still debate some details of those early years.",
    ),
    "animal": (
        "It is rarely seen by casual visitors.",
        "Researchers have only recently begun to study its behaviour.",
        "It is most active around dawn and dusk.",
        "Its numbers have been stable for several decades.",
        "Local children sometimes keep it as a pet.",
        "It is listed in several regional field guides.",
    ),
    "plant": (
        "Gardeners consider it easy to grow.",
        "Its leaves have a faint smell of lemon.",
        "Bees visit its flowers in large numbers.",
        "It spreads quickly once it is established.",
        "Dried stems are sometimes sold at markets.",
        "It rarely survives a hard frost.",
    ),
    "river": (
        "Its banks are lined with willows and alders.",
        "Small ferries cross it at several points.",
        "The water is clear and cold for most of the year.",
        "Floods were common until dams were built in the last century.",
        "Anglers value it for its trout and grayling.",
        "Old mills still stand along parts of its course.",
    ),
    "invention": (
        "Several early models are kept in museums today.",
        "The design was copied widely within a few decades.",
        "Early versions were heavy and difficult to repair.",
        "It was later improved by craftsmen in other towns.",
        "Some workshops still make it by hand.",
        "At first, many people doubted that it would work.",
    ),
    "dish": (
        "Recipes differ from one village to the next.",
        "It is usually eaten with a glass of cider.",
        "Many families guard their own version of the recipe.",
        "Street vendors sell small portions of it.",
        "It keeps well for several days.",
        "Cookery books from the last century describe it in detail.",
    ),
}


# ---------------------------------------------------------------------------
# Names.
# ---------------------------------------------------------------------------


class _NameFactory:
  """Invents pronounceable words; never returns the same word twice, nor a
  word of `forbidden` (the public corpus passes the private sample's words;
  with none, the draws are exactly those of the sample)."""

  def __init__(self, rng: random.Random, forbidden=frozenset()):
    self._rng = rng
    self._used: set[str] = set()
    self._forbidden = frozenset(forbidden)

  def word(self, min_syllables: int = 2, max_syllables: int = 3) -> str:
    rng = self._rng
    while True:
      n = rng.randint(min_syllables, max_syllables)
      parts = []
      for i in range(n):
        coda = rng.choice(_CODAS) if i == n - 1 else rng.choice(_CODAS[:6])
        parts.append(rng.choice(_ONSETS) + rng.choice(_VOWELS) + coda)
      w = "".join(parts)
      if 5 <= len(w) <= 11 and w not in self._used and w not in self._forbidden:
        self._used.add(w)
        return w


def _cap(s: str) -> str:
  return s[0].upper() + s[1:]


def _a(word: str) -> str:
  """`word` with its indefinite article ("a lizard", "an owl")."""
  return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(word: str) -> str:
  if word == "fish":
    return word
  if word.endswith("y"):
    return word[:-1] + "ies"
  if word.endswith(("s", "sh", "ch", "x")):
    return word + "es"
  return word + "s"


def _fmt_int(n: int) -> str:
  return f"{n:,}"


# ---------------------------------------------------------------------------
# Entities: each type defines attributes, passage sentences and query forms.
# A sentence / query template is a callable taking the entity dict.
# ---------------------------------------------------------------------------


class _Pools:
  """Value pools (names used as attribute values, never as entity names)."""

  def __init__(self, rng: random.Random, names: _NameFactory,
               first_names: tuple[str, ...] = _FIRST_NAMES):
    self.first_names = first_names  # draws no random numbers
    self.regions = [_cap(names.word(2, 3)) for _ in range(40)]
    self.rivers = [_cap(names.word(2, 2)) for _ in range(80)]
    self.towns = [_cap(names.word(2, 3)) + rng.choice(_TOWN_SUFFIXES)
                  for _ in range(150)]
    self.surnames = [_cap(names.word(2, 3)) for _ in range(200)]
    self.mountains = [_cap(names.word(2, 2)) for _ in range(30)]
    self.seas = [_cap(names.word(2, 2)) for _ in range(20)]
    self.rng = rng

  def person(self) -> str:
    return f"{self.rng.choice(self.first_names)} {self.rng.choice(self.surnames)}"


def _make_town(rng, names, pools):
  name = _cap(names.word(2, 3)) + rng.choice(_TOWN_SUFFIXES)
  pop = rng.choice((rng.randint(800, 9000), rng.randint(9000, 60000),
                    rng.randint(60000, 250000)))
  size = ("small" if pop < 9000 else "mid-sized" if pop < 60000 else "large")
  return dict(
      type="town", name=name, key=name.lower(), size=size,
      region=rng.choice(pools.regions), year=rng.randint(1100, 1899),
      founder=pools.person(), founder_job=rng.choice(_PROFESSIONS),
      river=rng.choice(pools.rivers), pop=_fmt_int(pop),
      export=rng.choice(_EXPORTS), landmark=rng.choice(_LANDMARKS),
  )


def _make_person(rng, names, pools):
  born = rng.randint(1300, 1930)
  name = f"{rng.choice(pools.first_names)} {_cap(names.word(2, 3))}"
  return dict(
      type="person", name=name, key=name.split()[1].lower(), born=born,
      died=born + rng.randint(28, 95), birthplace=rng.choice(pools.towns),
      job=rng.choice(_PROFESSIONS),
      work=f"The {rng.choice(_WORK_NOUNS)} of {rng.choice(_WORK_OF)}",
  )


def _make_animal(rng, names, pools):
  core = names.word(2, 3)
  cls = rng.choice(_ANIMAL_CLASSES)
  big = cls in ("bird", "fish", "lizard", "bat", "owl", "salamander")
  habitats = _WATER_HABITATS if cls in ("fish", "crab") else _HABITATS
  return dict(
      type="animal", name=f"{rng.choice(_ANIMAL_PREFIXES)} {core}", key=core,
      cls=cls, colour=rng.choice(_COLOURS), habitat=rng.choice(habitats),
      diet=rng.choice(_DIETS), life=rng.randint(2, 9) if not big else
      rng.randint(5, 40), length=rng.randint(2, 12) if not big else
      rng.randint(12, 90),
  )


def _make_plant(rng, names, pools):
  core = names.word(2, 3)
  kind = rng.choice(_PLANT_KINDS)
  return dict(
      type="plant", name=f"{rng.choice(_PLANT_PREFIXES)} {core} {kind}",
      key=core, kind=kind, colour=rng.choice(_COLOURS),
      season=rng.choice(_SEASONS), use=rng.choice(_PLANT_USES),
      soil=rng.choice(_SOILS), height=rng.randint(5, 240),
      region=rng.choice(pools.regions),
  )


def _make_river(rng, names, pools):
  core = _cap(names.word(2, 3))
  t1, t2 = rng.sample(pools.towns, 2)
  return dict(
      type="river", name=f"{core} River", key=core.lower(),
      length=rng.randint(40, 2400),
      source=rng.choice((f"the {rng.choice(pools.mountains)} Mountains",
                         f"Lake {rng.choice(pools.mountains)}",
                         f"the springs of {rng.choice(pools.towns)}")),
      mouth=rng.choice((f"the {rng.choice(pools.seas)} Sea",
                        f"the Gulf of {rng.choice(pools.seas)}",
                        f"Lake {rng.choice(pools.seas)}")),
      tributary=rng.choice(pools.rivers), town1=t1, town2=t2,
      fish=rng.choice(("trout", "carp", "pike", "salmon", "eels", "perch")),
  )


def _make_invention(rng, names, pools):
  core = names.word(2, 2) + rng.choice(_INVENTION_WORDS)
  mat, mat2 = rng.sample(_MATERIALS, 2)
  return dict(
      type="invention", name=f"{mat} {core}", key=core, material=mat,
      material2=mat2, inventor=pools.person(),
      year=rng.randint(1400, 1990), purpose=rng.choice(_PURPOSES),
      place=rng.choice(pools.towns),
  )


def _make_dish(rng, names, pools):
  core = names.word(2, 3)
  kind = rng.choice(_DISH_KINDS)
  ing1, ing2 = rng.sample(_INGREDIENTS, 2)
  return dict(
      type="dish", name=f"{core} {kind}", key=core, kind=kind,
      region=rng.choice(pools.regions), ing=ing1, ing2=ing2,
      occasion=rng.choice(_OCCASIONS), method=rng.choice(_METHODS),
      taste=rng.choice(_TASTES),
  )


_MAKERS = {
    "town": _make_town, "person": _make_person, "animal": _make_animal,
    "plant": _make_plant, "river": _make_river, "invention": _make_invention,
    "dish": _make_dish,
}
ENTITY_TYPES = tuple(_MAKERS)

_S = Callable[[dict], str]

# Opening sentences (must contain the name), each with the attributes whose
# fact sentence it makes redundant. Keys: entity type.
_OPENINGS: dict[str, tuple[tuple[tuple[str, ...], _S], ...]] = {
    "town": (
        ((), lambda e: f"{e['name']} is {_a(e['size'])} town in the province of {e['region']}."),
        ((), lambda e: f"Located in {e['region']} province, {e['name']} is {_a(e['size'])} town with a long history."),
        ((), lambda e: f"The town of {e['name']} lies in the {e['region']} region."),
    ),
    "person": (
        (("job", "work"), lambda e: f"{e['name']} was {_a(e['job'])} remembered for {e['work']}."),
        (("died", "job"), lambda e: f"{e['name']} ({e['born']}-{e['died']}) was a well-known {e['job']}."),
        (("job", "work"), lambda e: f"The {e['job']} {e['name']} is best known as the author of {e['work']}."),
    ),
    "animal": (
        (("cls", "habitat"), lambda e: f"The {e['name']} is a small {e['cls']} found mainly in {e['habitat']}."),
        (("cls",), lambda e: f"The {e['name']} is a species of {e['cls']}."),
        (("cls",), lambda e: f"Among the {_plural(e['cls'])} of the region, the {e['name']} is one of the most distinctive."),
    ),
    "plant": (
        ((), lambda e: f"The {e['name']} is a flowering plant native to {e['region']}."),
        (("soil",), lambda e: f"{_cap(e['name'])} is a hardy {e['kind']} that grows in {e['soil']}."),
        ((), lambda e: f"Native to the province of {e['region']}, the {e['name']} is a common sight in summer."),
    ),
    "river": (
        (("length",), lambda e: f"The {e['name']} is a river that is {_fmt_int(e['length'])} kilometres long."),
        (("source", "mouth"), lambda e: f"The {e['name']} flows from {e['source']} to {e['mouth']}."),
        (("source",), lambda e: f"Rising in {e['source']}, the {e['name']} is one of the main waterways of the region."),
    ),
    "invention": (
        (("purpose",), lambda e: f"The {e['name']} is a device used to {e['purpose']}."),
        (("inventor", "year"), lambda e: f"The {e['name']} was invented by {e['inventor']} in {e['year']}."),
        (("place",), lambda e: f"First built in {e['place']}, the {e['name']} is a simple but clever machine."),
    ),
    "dish": (
        (("region",), lambda e: f"{_cap(e['name'])} is a traditional dish from the province of {e['region']}."),
        (("taste", "ing"), lambda e: f"{_cap(e['name'])} is {_a(e['taste'])} dish made mainly from {e['ing']}."),
        (("region", "occasion"), lambda e: f"In {e['region']}, {e['name']} is traditionally served during {e['occasion']}."),
    ),
}

# Attribute sentences: type -> attribute -> templates. Every attribute of an
# entity is stated in its passage (openings may state it a second time).
_FACTS: dict[str, dict[str, tuple[_S, ...]]] = {
    "town": {
        "year": (
            lambda e: f"It was founded in {e['year']} by the {e['founder_job']} {e['founder']}.",
            lambda e: f"{e['founder']}, {_a(e['founder_job'])}, established the settlement in {e['year']}.",
            lambda e: f"According to local records, {e['name']} was founded in {e['year']} by {e['founder']}.",
        ),
        "river": (
            lambda e: f"The {e['river']} River runs through the centre of the town.",
            lambda e: f"It sits on the banks of the {e['river']} River.",
            lambda e: f"The town grew up around a ford on the {e['river']} River.",
        ),
        "pop": (
            lambda e: f"Today it has a population of about {e['pop']}.",
            lambda e: f"At the last census, {e['pop']} people lived there.",
            lambda e: f"Its population stands at roughly {e['pop']} residents.",
        ),
        "export": (
            lambda e: f"The town's main export is {e['export']}.",
            lambda e: f"{e['name']} is best known for exporting {e['export']}.",
            lambda e: f"Most of the local economy depends on {e['export']}, its chief export.",
        ),
        "landmark": (
            lambda e: f"Visitors come to see {e['landmark']}.",
            lambda e: f"Its most famous landmark is {e['landmark']}.",
            lambda e: f"The town is famous for {e['landmark']} near the old gate.",
        ),
    },
    "person": {
        "born": (
            lambda e: f"Born in {e['birthplace']} in {e['born']}, {e['key_cap']} showed talent at an early age.",
            lambda e: f"{e['name']} was born in {e['born']} in the town of {e['birthplace']}.",
            lambda e: f"The {e['job']} was born in {e['birthplace']} in the year {e['born']}.",
        ),
        "died": (
            lambda e: f"{e['key_cap']} died in {e['died']}.",
            lambda e: f"The death of {e['name']} in {e['died']} was widely mourned.",
            lambda e: f"{e['key_cap']} lived until {e['died']}.",
        ),
        "job": (
            lambda e: f"By profession {e['key_cap']} was {_a(e['job'])}.",
            lambda e: f"{e['key_cap']} worked as {_a(e['job'])} for most of a long career.",
            lambda e: f"Trained as {_a(e['job'])}, {e['key_cap']} later taught many apprentices.",
        ),
        "work": (
            lambda e: f"The most famous work of {e['key_cap']} is {e['work']}.",
            lambda e: f"{e['key_cap']} is remembered above all for {e['work']}.",
            lambda e: f"{e['work']} remains the best-known work of {e['name']}.",
        ),
    },
    "animal": {
        "colour": (
            lambda e: f"Its body is {e['colour']} with faint darker markings.",
            lambda e: f"Adults are {e['colour']} in colour.",
            lambda e: f"It can be recognised by its {e['colour']} colouring.",
        ),
        "habitat": (
            lambda e: f"It lives in {e['habitat']}.",
            lambda e: f"Its natural habitat is {e['habitat']}.",
            lambda e: f"The species is found in {e['habitat']}.",
        ),
        "diet": (
            lambda e: f"It feeds mostly on {e['diet']}.",
            lambda e: f"Its diet consists mainly of {e['diet']}.",
            lambda e: f"The {e['name']} eats {e['diet']}.",
        ),
        "life": (
            lambda e: f"It can live for up to {e['life']} years.",
            lambda e: f"Its lifespan is about {e['life']} years.",
            lambda e: f"In the wild the {e['name']} lives around {e['life']} years.",
        ),
        "length": (
            lambda e: f"Adults grow to about {e['length']} centimetres in length.",
            lambda e: f"It measures roughly {e['length']} cm from head to tail.",
            lambda e: f"A fully grown {e['name']} is about {e['length']} centimetres long.",
        ),
        "cls": (
            lambda e: f"It is {_a(e['cls'])}.",
            lambda e: f"Scientists classify it as {_a(e['cls'])}.",
            lambda e: f"Like other {_plural(e['cls'])}, it is easily disturbed.",
        ),
    },
    "plant": {
        "colour": (
            lambda e: f"Its flowers are {e['colour']}.",
            lambda e: f"It produces small {e['colour']} flowers.",
            lambda e: f"The {e['colour']} blossoms are easy to spot.",
        ),
        "season": (
            lambda e: f"It blooms in {e['season']}.",
            lambda e: f"Flowering takes place in {e['season']}.",
            lambda e: f"The plant flowers during {e['season']}.",
        ),
        "use": (
            lambda e: f"People use it for {e['use']}.",
            lambda e: f"It has long been used for {e['use']}.",
            lambda e: f"Villagers gather it for {e['use']}.",
        ),
        "height": (
            lambda e: f"It grows up to {e['height']} centimetres tall.",
            lambda e: f"Mature plants reach a height of about {e['height']} cm.",
            lambda e: f"It can grow to {e['height']} centimetres in height.",
        ),
        "soil": (
            lambda e: f"It prefers {e['soil']}.",
            lambda e: f"It grows best in {e['soil']}.",
            lambda e: f"It is usually found on {e['soil']}.",
        ),
    },
    "river": {
        "length": (
            lambda e: f"It is {_fmt_int(e['length'])} kilometres long.",
            lambda e: f"The river has a total length of {_fmt_int(e['length'])} km.",
            lambda e: f"Its course is about {_fmt_int(e['length'])} kilometres in length.",
        ),
        "source": (
            lambda e: f"Its source is in {e['source']}.",
            lambda e: f"The river begins in {e['source']}.",
            lambda e: f"It rises in {e['source']}.",
        ),
        "mouth": (
            lambda e: f"It empties into {e['mouth']}.",
            lambda e: f"The river flows into {e['mouth']}.",
            lambda e: f"Its mouth lies on {e['mouth']}.",
        ),
        "tributary": (
            lambda e: f"Its main tributary is the {e['tributary']}.",
            lambda e: f"The {e['tributary']} joins it as its largest tributary.",
            lambda e: f"The biggest river feeding it is the {e['tributary']}.",
        ),
        "towns": (
            lambda e: f"It passes the towns of {e['town1']} and {e['town2']}.",
            lambda e: f"Along its course lie {e['town1']} and {e['town2']}.",
            lambda e: f"The towns of {e['town1']} and {e['town2']} were built on its banks.",
        ),
        "fish": (
            lambda e: f"Fishermen catch {e['fish']} in its lower reaches.",
            lambda e: f"The river is known for its {e['fish']}.",
        ),
    },
    "invention": {
        "inventor": (
            lambda e: f"It was invented by {e['inventor']}.",
            lambda e: f"Its inventor was {e['inventor']}.",
            lambda e: f"{e['inventor']} designed the first one.",
        ),
        "year": (
            lambda e: f"The first working model was built in {e['year']}.",
            lambda e: f"It was first made in {e['year']}.",
            lambda e: f"The invention dates from {e['year']}.",
        ),
        "purpose": (
            lambda e: f"It is used to {e['purpose']}.",
            lambda e: f"People use it to {e['purpose']}.",
            lambda e: f"Its purpose is to {e['purpose']}.",
        ),
        "material": (
            lambda e: f"It is made of {e['material']} and {e['material2']}.",
            lambda e: f"The frame is {e['material']}, with parts made of {e['material2']}.",
            lambda e: f"Most examples are built from {e['material']} and {e['material2']}.",
        ),
        "place": (
            lambda e: f"It was invented in the town of {e['place']}.",
            lambda e: f"The first one was made in a workshop in {e['place']}.",
            lambda e: f"{e['place']} claims to be the place where it was invented.",
        ),
    },
    "dish": {
        "region": (
            lambda e: f"It comes from the province of {e['region']}.",
            lambda e: f"The dish originated in {e['region']}.",
            lambda e: f"It is a speciality of {e['region']}.",
        ),
        "ing": (
            lambda e: f"Its main ingredient is {e['ing']}, often mixed with {e['ing2']}.",
            lambda e: f"It is made mainly from {e['ing']} and {e['ing2']}.",
            lambda e: f"The basic recipe calls for {e['ing']} with a little {e['ing2']}.",
        ),
        "occasion": (
            lambda e: f"It is traditionally eaten during {e['occasion']}.",
            lambda e: f"Families serve it at {e['occasion']}.",
            lambda e: f"It is a favourite dish for {e['occasion']}.",
        ),
        "method": (
            lambda e: f"It is {e['method']}.",
            lambda e: f"The dish is usually {e['method']}.",
            lambda e: f"Cooks prepare it {e['method']}.",
        ),
        "taste": (
            lambda e: f"Its taste is {e['taste']}.",
            lambda e: f"The flavour is described as {e['taste']}.",
        ),
    },
}

# Query forms: type -> attribute -> templates (lower-cased afterwards, as in
# MSMARCO). Only attributes listed here are asked about.
_QUERIES: dict[str, dict[str, tuple[_S, ...]]] = {
    "town": {
        "year": (
            lambda e: f"what year was the town of {e['name']} founded",
            lambda e: f"when was {e['name']} founded",
            lambda e: f"{e['name']} founding year",
            lambda e: f"when was the town of {e['name']} established",
        ),
        "founder": (
            lambda e: f"who founded {e['name']}",
            lambda e: f"founder of {e['name']}",
            lambda e: f"who established the town of {e['name']}",
        ),
        "river": (
            lambda e: f"what river runs through {e['name']}",
            lambda e: f"which river is {e['name']} on",
            lambda e: f"{e['name']} river",
        ),
        "pop": (
            lambda e: f"population of {e['name']}",
            lambda e: f"how many people live in {e['name']}",
            lambda e: f"what is the population of {e['name']}",
        ),
        "export": (
            lambda e: f"what does {e['name']} export",
            lambda e: f"main export of {e['name']}",
            lambda e: f"{e['name']} chief export",
        ),
        "region": (
            lambda e: f"what province is {e['name']} in",
            lambda e: f"where is {e['name']} located",
            lambda e: f"{e['name']} is in which region",
        ),
        "landmark": (
            lambda e: f"what is {e['name']} famous for",
            lambda e: f"landmarks in {e['name']}",
        ),
    },
    "person": {
        "born": (
            lambda e: f"when was {e['name']} born",
            lambda e: f"{e['name']} birth year",
            lambda e: f"what year was {e['name']} born",
        ),
        "birthplace": (
            lambda e: f"where was {e['name']} born",
            lambda e: f"{e['name']} birthplace",
            lambda e: f"what town is {e['name']} from",
        ),
        "died": (
            lambda e: f"when did {e['name']} die",
            lambda e: f"{e['name']} death year",
            lambda e: f"what year did {e['name']} die",
        ),
        "job": (
            lambda e: f"what was {e['name']}'s profession",
            lambda e: f"{e['name']} occupation",
            lambda e: f"what did {e['name']} do for a living",
            lambda e: f"who was {e['name']}",
        ),
        "work": (
            lambda e: f"what is {e['name']} known for",
            lambda e: f"{e['name']} most famous work",
            lambda e: f"what did {e['name']} create",
        ),
    },
    "animal": {
        "colour": (
            lambda e: f"what color is the {e['name']}",
            lambda e: f"{e['name']} colour",
            lambda e: f"what does {_a(e['name'])} look like",
        ),
        "habitat": (
            lambda e: f"where does the {e['name']} live",
            lambda e: f"{e['name']} habitat",
            lambda e: f"where can you find {_a(e['name'])}",
        ),
        "diet": (
            lambda e: f"what does the {e['name']} eat",
            lambda e: f"{e['name']} diet",
            lambda e: f"what do {e['name']} feed on",
        ),
        "life": (
            lambda e: f"how long does {_a(e['name'])} live",
            lambda e: f"{e['name']} lifespan",
        ),
        "length": (
            lambda e: f"how big is {_a(e['name'])}",
            lambda e: f"{e['name']} size",
            lambda e: f"how long is the {e['name']}",
        ),
        "cls": (
            lambda e: f"what kind of animal is {_a(e['name'])}",
            lambda e: f"is the {e['name']} {_a(e['cls'])}",
        ),
    },
    "plant": {
        "colour": (
            lambda e: f"what color are {e['name']} flowers",
            lambda e: f"{e['name']} flower colour",
        ),
        "season": (
            lambda e: f"when does the {e['name']} bloom",
            lambda e: f"{e['name']} flowering season",
        ),
        "use": (
            lambda e: f"what is {e['name']} used for",
            lambda e: f"{e['name']} uses",
            lambda e: f"what can you do with {e['name']}",
        ),
        "height": (
            lambda e: f"how tall does {e['name']} grow",
            lambda e: f"{e['name']} height",
        ),
        "soil": (
            lambda e: f"where does {e['name']} grow",
            lambda e: f"best soil for {e['name']}",
        ),
    },
    "river": {
        "length": (
            lambda e: f"how long is the {e['name']}",
            lambda e: f"{e['name']} length",
            lambda e: f"length of the {e['name']} in km",
        ),
        "source": (
            lambda e: f"where does the {e['name']} start",
            lambda e: f"source of the {e['name']}",
            lambda e: f"where does the {e['name']} begin",
        ),
        "mouth": (
            lambda e: f"where does the {e['name']} end",
            lambda e: f"what does the {e['name']} flow into",
            lambda e: f"{e['name']} mouth",
        ),
        "tributary": (
            lambda e: f"main tributary of the {e['name']}",
            lambda e: f"what river flows into the {e['name']}",
        ),
        "towns": (
            lambda e: f"what towns are on the {e['name']}",
            lambda e: f"towns along the {e['name']}",
        ),
    },
    "invention": {
        "inventor": (
            lambda e: f"who invented the {e['name']}",
            lambda e: f"{e['name']} inventor",
            lambda e: f"who made the first {e['name']}",
        ),
        "year": (
            lambda e: f"when was the {e['name']} invented",
            lambda e: f"what year was the {e['name']} invented",
            lambda e: f"{e['name']} invention date",
        ),
        "purpose": (
            lambda e: f"what is {_a(e['name'])} used for",
            lambda e: f"what does {_a(e['name'])} do",
            lambda e: f"purpose of the {e['name']}",
        ),
        "material": (
            lambda e: f"what is {_a(e['name'])} made of",
            lambda e: f"{e['name']} materials",
        ),
        "place": (
            lambda e: f"where was the {e['name']} invented",
            lambda e: f"in which town was the {e['name']} invented",
        ),
    },
    "dish": {
        "ing": (
            lambda e: f"what is {e['name']} made of",
            lambda e: f"main ingredient in {e['name']}",
            lambda e: f"{e['name']} ingredients",
        ),
        "region": (
            lambda e: f"where does {e['name']} come from",
            lambda e: f"{e['name']} origin",
        ),
        "occasion": (
            lambda e: f"when is {e['name']} eaten",
            lambda e: f"what occasion is {e['name']} served at",
        ),
        "method": (
            lambda e: f"how is {e['name']} cooked",
            lambda e: f"how to make {e['name']}",
        ),
        "taste": (
            lambda e: f"what does {e['name']} taste like",
        ),
    },
}


# ---------------------------------------------------------------------------
# Passages and queries.
# ---------------------------------------------------------------------------


def _word_count(text: str) -> int:
  return len(text.split())


def _passage(rng: random.Random, e: dict) -> str:
  """Renders one 40-90 word passage stating every attribute of `e`."""
  etype = e["type"]
  for _ in range(50):
    covered, opening_fn = rng.choice(_OPENINGS[etype])
    opening = opening_fn(e)
    facts = [rng.choice(t)(e) for attr, t in _FACTS[etype].items()
             if attr not in covered]
    rng.shuffle(facts)
    fillers = list(_FILLERS[etype])
    rng.shuffle(fillers)
    sentences = [opening] + facts
    n_fill = rng.randint(0, 2)
    sentences += fillers[:n_fill]
    fillers = fillers[n_fill:]
    while _word_count(" ".join(sentences)) < MIN_WORDS and fillers:
      sentences.append(fillers.pop())
    text = " ".join(sentences)
    if MIN_WORDS <= _word_count(text) <= MAX_WORDS:
      return text
  raise RuntimeError(f"could not render a passage for {e['name']}")


def _query(rng: random.Random, e: dict, attribute: str) -> str:
  q = rng.choice(_QUERIES[e["type"]][attribute])(e)
  q = q.lower()
  if rng.random() < 0.12:
    q += "?"
  if rng.random() < 0.08:
    q = _cap(q)
  return re.sub(r"\s+", " ", q).strip()


def _make_entity(rng, names, pools) -> dict:
  etype = rng.choice(ENTITY_TYPES)
  e = _MAKERS[etype](rng, names, pools)
  e["key_cap"] = e["name"].split()[-1] if etype == "person" else e["name"]
  return e


def build_world(seed: int = SEED, *, forbidden_words=frozenset(),
                first_names: tuple[str, ...] = _FIRST_NAMES) -> dict:
  """Builds the sample in memory.

  Returns a dict with `collection` (list of (pid, passage)), `queries` and
  `qrels` (dicts keyed by split 'train'/'dev' of lists of (qid, query) and
  (qid, pid)). `forbidden_words` (lower-case) are never drawn as invented
  words and `first_names` replaces the persons' first names: both only for
  the public corpus (`generate_public_corpus`); the defaults give the sample.
  """
  rng = random.Random(seed)
  names = _NameFactory(rng, forbidden_words)
  pools = _Pools(rng, names, first_names)

  groups = {
      "train": [_make_entity(rng, names, pools) for _ in range(NUM_TRAIN_ENTITIES)],
      "dev": [_make_entity(rng, names, pools) for _ in range(NUM_DEV_ENTITIES)],
      "distractor": [_make_entity(rng, names, pools)
                     for _ in range(NUM_DISTRACTOR_ENTITIES)],
  }
  entities = groups["train"] + groups["dev"] + groups["distractor"]
  passages = [_passage(rng, e) for e in entities]

  # MSMARCO pids are 0..N-1 in collection order; shuffle the entity order.
  order = list(range(len(entities)))
  rng.shuffle(order)
  pid_of = {}  # entity index -> pid
  collection = []
  for pid, idx in enumerate(order):
    pid_of[idx] = pid
    collection.append((pid, passages[idx]))

  used_qids: set[int] = set()

  def new_qid() -> int:
    while True:
      qid = rng.randint(1, 1_200_000)
      if qid not in used_qids:
        used_qids.add(qid)
        return qid

  queries, qrels = {}, {}
  offset = {"train": 0, "dev": NUM_TRAIN_ENTITIES}
  for split in ("train", "dev"):
    split_queries, split_qrels = [], []
    for i, e in enumerate(groups[split]):
      attributes = list(_QUERIES[e["type"]])
      n = 2 if rng.random() < SECOND_QUERY_PROB else 1
      for attribute in rng.sample(attributes, n):
        qid = new_qid()
        split_queries.append((qid, _query(rng, e, attribute)))
        split_qrels.append((qid, pid_of[offset[split] + i]))
    rng.shuffle(split_queries)  # queries.*.tsv are not sorted in MSMARCO.
    split_qrels.sort()
    queries[split], qrels[split] = split_queries, split_qrels
  return dict(collection=collection, queries=queries, qrels=qrels)


# ---------------------------------------------------------------------------
# Writing files and training SentencePiece.
# ---------------------------------------------------------------------------


def _write_lines(path: str, lines) -> None:
  with open(path, "w", encoding="utf-8", newline="\n") as f:
    for line in lines:
      f.write(line + "\n")


def train_sentencepiece(texts, model_prefix: str,
                        vocab_size: int = SPM_VOCAB_SIZE) -> None:
  """Trains a T5-style (pad 0, eos 1, unk 2, no bos) unigram model."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  spm.set_random_generator_seed(SPM_SEED)
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(list(texts)),
      model_prefix=model_prefix,
      model_type="unigram",
      vocab_size=vocab_size,
      character_coverage=1.0,
      pad_id=0,
      eos_id=1,
      unk_id=2,
      bos_id=-1,
      num_threads=1,
      input_sentence_size=0,
      shuffle_input_sentence=False,
      max_sentence_length=8192,
      minloglevel=2,
  )
  # The model proto records the output path; keep only the base name so the
  # bytes do not depend on where the sample was generated.
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top

  model_file = model_prefix + ".model"
  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_file, "rb") as f:
    proto.ParseFromString(f.read())
  proto.trainer_spec.model_prefix = os.path.basename(model_prefix)
  with open(model_file, "wb") as f:
    f.write(proto.SerializeToString(deterministic=True))


def _stats_readme(world: dict, model_file: str | None) -> str:
  coll = [t for _, t in world["collection"]]
  referenced = {pid for s in ("train", "dev") for _, pid in world["qrels"][s]}
  lines = [
      "# msmarco_sample",
      "",
      "A fictional, MSMARCO-format sample generated by",
      "`python -m tasks.msmarco_sample.generate` (deterministic; do not edit by",
      "hand). Every passage describes one invented entity; every query asks",
      "about one attribute of one entity, named by its unique invented name.",
      "Layout follows MSMARCO passage ranking: `collection.tsv` (pid, passage),",
      "`queries.{train,dev}.tsv` (qid, query), `qrels.{train,dev}.tsv`",
      "(qid, 0, pid, 1). `spm/` holds a SentencePiece unigram model",
      f"(vocab {SPM_VOCAB_SIZE}; pad=0, eos=1, unk=2, no bos, like T5's).",
      "",
      "| statistic | value |",
      "| --- | --- |",
      f"| passages | {len(coll)} |",
      f"| passages referenced by no query (distractors) | {len(coll) - len(referenced)} |",
  ]
  for split in ("train", "dev"):
    n_pids = len({pid for _, pid in world["qrels"][split]})
    lines.append(f"| {split} queries (= qrels rows) | {len(world['queries'][split])} |")
    lines.append(f"| {split} distinct passages | {n_pids} |")
  words = [len(t.split()) for t in coll]
  lines.append(f"| passage words: mean / min / max | "
               f"{sum(words) / len(words):.1f} / {min(words)} / {max(words)} |")
  if model_file is not None:
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    sp = spm.SentencePieceProcessor(model_file=model_file)
    p_toks = [len(x) for x in sp.encode(coll)]
    qs = [q for s in ("train", "dev") for _, q in world["queries"][s]]
    q_toks = [len(x) for x in sp.encode(qs)]
    lines.append(f"| passage spm tokens: mean / max | "
                 f"{sum(p_toks) / len(p_toks):.1f} / {max(p_toks)} |")
    lines.append(f"| query spm tokens: mean / max | "
                 f"{sum(q_toks) / len(q_toks):.1f} / {max(q_toks)} |")
  return "\n".join(lines) + "\n"


def generate(output_dir: str = DEFAULT_OUTPUT_DIR, *, seed: int = SEED,
             train_spm: bool = True) -> dict:
  """Writes the sample (and, if `train_spm`, the spm model) to `output_dir`.

  Returns the in-memory world (see `build_world`).
  """
  world = build_world(seed)
  os.makedirs(output_dir, exist_ok=True)
  _write_lines(os.path.join(output_dir, "collection.tsv"),
               (f"{pid}\t{text}" for pid, text in world["collection"]))
  for split in ("train", "dev"):
    _write_lines(os.path.join(output_dir, f"queries.{split}.tsv"),
                 (f"{qid}\t{q}" for qid, q in world["queries"][split]))
    _write_lines(os.path.join(output_dir, f"qrels.{split}.tsv"),
                 (f"{qid}\t0\t{pid}\t1" for qid, pid in world["qrels"][split]))
  model_file = None
  if train_spm:
    spm_dir = os.path.join(output_dir, SPM_SUBDIR)
    os.makedirs(spm_dir, exist_ok=True)
    prefix = os.path.join(spm_dir, SPM_MODEL_NAME)
    # The task's own text in a fixed order: model inputs ("generate_query: "
    # + passage, the prefix of tasks.msmarco.INPUT_PREFIX), then the train
    # queries (dev queries are held out on purpose), then one line with every
    # printable ASCII character so that none of them is ever <unk>.
    texts = [TASK_INPUT_PREFIX + t for _, t in world["collection"]]
    texts += [q for _, q in world["queries"]["train"]]
    texts.append(" ".join(string.printable[:94]))
    train_sentencepiece(texts, prefix)
    model_file = prefix + ".model"
  with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8",
            newline="\n") as f:
    f.write(_stats_readme(world, model_file))
  return world


# ---------------------------------------------------------------------------
# The public pretraining corpus.
# ---------------------------------------------------------------------------


def _words(text: str) -> list[str]:
  """The lower-cased letter runs of `text` (its words, as the checks see them)."""
  return re.findall(r"[a-z]+", text.lower())


def _world_texts(world: dict) -> list[str]:
  """Every passage and every (train and dev) query of `world`."""
  return ([t for _, t in world["collection"]]
          + [q for s in ("train", "dev") for _, q in world["queries"][s]])


def _forbidden_words(sample_words) -> frozenset[str]:
  """The sample's words, plus each one less any town-name or invention-word
  suffix: an invented word outside this set stays outside the sample's words
  when `_make_town` / `_make_invention` / `_Pools` glue such a suffix to it."""
  suffixes = [x for x in _TOWN_SUFFIXES + _INVENTION_WORDS if x]
  forbidden = set(sample_words)
  for w in sample_words:
    forbidden.update(w[:-len(x)] for x in suffixes if w.endswith(x) and w != x)
  return frozenset(forbidden)


def _template_words() -> set[str]:
  """The words written in this module (templates, pools, fillers) and their
  `_plural`s, less the sample's first names: the world's shared language,
  never an invented name (those are drawn at run time)."""
  with open(os.path.abspath(__file__), encoding="utf-8") as f:
    words = set(_words(f.read()))
  words |= {_plural(w) for w in words}
  return words - {n.lower() for n in _FIRST_NAMES}


def build_public_documents(seed: int = PUBLIC_SEED) -> dict:
  """The public corpus in memory: {"train": [doc, ...], "validation": [...]}.

  A document is one passage or one query (no "generate_query: " prefix) of
  the world `build_world(seed, ...)` makes with every invented word drawn
  outside the sample's words (`build_world(SEED)`) and with
  `_PUBLIC_FIRST_NAMES`. About PUBLIC_VALIDATION_FRACTION of the passages,
  with their queries, are held out as validation. Raises if a public name,
  or any digit run longer than 4, could leak from the sample.
  """
  sample_words = {w for t in _world_texts(build_world(SEED)) for w in _words(t)}
  clash = [n for n in _PUBLIC_FIRST_NAMES
           if n.lower() in sample_words or n in _FIRST_NAMES]
  if clash:
    raise ValueError(f"public first names occur in the sample: {clash}")
  world = build_world(seed, forbidden_words=_forbidden_words(sample_words),
                      first_names=_PUBLIC_FIRST_NAMES)

  # One group per passage: the passage, then its queries (qrels order).
  groups = {pid: [text] for pid, text in world["collection"]}
  for split in ("train", "dev"):
    query_text = dict(world["queries"][split])
    for qid, pid in world["qrels"][split]:
      groups[pid].append(query_text[qid])

  rng = random.Random(seed)
  pids = sorted(groups)
  n_val = max(1, round(PUBLIC_VALIDATION_FRACTION * len(pids)))
  val_pids = set(rng.sample(pids, n_val))
  seen: set[str] = set()
  docs = {"train": [], "validation": []}
  for pid in pids:
    split = "validation" if pid in val_pids else "train"
    for doc in groups[pid]:
      if doc not in seen:  # a document is in one split, once
        seen.add(doc)
        docs[split].append(doc)
  for split in ("train", "validation"):
    rng.shuffle(docs[split])

  # Safety nets (the tests check the committed files independently).
  shared = {w for d in seen for w in _words(d)} & sample_words
  leaked = sorted(shared - _template_words())
  if leaked:
    raise ValueError(f"public corpus shares non-template words with the "
                     f"sample: {leaked[:20]}")
  long_digits = [d for d in seen if re.search(r"[0-9]{5,}", d)]
  if long_digits:  # canary secrets are 10-digit strings
    raise ValueError(f"digit runs longer than 4 in: {long_digits[:3]}")
  return docs


def _public_readme(stats: dict, seed: int) -> str:
  lines = [
      "# msmarco_public",
      "",
      "Public pretraining corpus for the MSMARCO-format sample",
      "(`tasks/data/msmarco_sample/`), generated by",
      "",
      "    python -m tasks.msmarco_sample.generate --public_corpus",
      "",
      "(deterministic; do not edit by hand; `--output_dir=DIR` writes",
      f"elsewhere). It is the sample generator's world for seed {seed}",
      "(`PUBLIC_SEED`): the same templates, attribute pools and query forms,",
      "other invented towns, persons, animals, plants, rivers, inventions and",
      "dishes. Each document is one passage or one query, as plain text (no",
      "`generate_query: ` prefix: the pretraining objective is span",
      "corruption on plain text), one JSON object per line:",
      "`{\"text\": doc}`. About 5% of the passages, with their queries, form",
      "`validation.jsonl`; no document is in both files. Every document",
      "encodes with `tasks/data/msmarco_sample/spm/msmarco_sample.model`",
      "without `<unk>`.",
      "",
      "| split | documents | passages | queries | words | characters |",
      "| --- | --- | --- | --- | --- | --- |",
  ]
  for split in ("train", "validation"):
    st = stats[split]
    lines.append(f"| {split} | {st['documents']} | {st['passages']} | "
                 f"{st['queries']} | {st['words']} | {st['characters']} |")
  lines += [
      "",
      "## Disjointness from the private sample",
      "",
      "* Invented names: every invented word (entity names, and the towns,",
      "  regions, rivers, mountains, seas and surnames used as attribute",
      "  values) is drawn outside the set of words of the sample's passages",
      "  and queries (and outside those words less a town or invention",
      "  suffix, so glued names stay outside too). Persons' first names come",
      "  from a separate list that shares no word with the sample.",
      "* So every word the corpus shares with the sample is template language",
      "  written in `tasks/msmarco_sample/generate.py` (\"river\", \"founded\",",
      "  \"copper\", \"stew\", ...); the generator raises otherwise, and",
      "  `tests/data/test_msmarco_public_corpus.py` checks it on the committed",
      "  files: shared words are all in the generator's source (less the",
      "  sample's first names), no first name or surname of a sample person",
      "  occurs, and no name of the corpus occurs in the sample.",
      "* Canaries (`dpjax.pipelines.retrieval.canaries`): their queries are sample",
      "  queries (each names a sample entity) plus a 10-digit secret; the",
      "  corpus has no digit run longer than 4 and none of the default canaries'",
      "  queries or secrets (checked by the test).",
      "* Shared on purpose: the templates, fillers, professions, titles of",
      "  works, exports, colours, habitats, ingredients and the like.",
  ]
  return "\n".join(lines) + "\n"


def generate_public_corpus(output_dir: str = DEFAULT_PUBLIC_DIR, *,
                           seed: int = PUBLIC_SEED) -> dict:
  """Writes `train.jsonl`, `validation.jsonl` and `README.md` of the public
  pretraining corpus (`build_public_documents`) to `output_dir`.

  Returns statistics: per split {"documents", "passages", "queries",
  "words", "characters"}, and "seed".
  """
  docs = build_public_documents(seed)
  queries = {q for q in docs["train"] + docs["validation"]
             if not q.endswith(".")}  # passages end with a full stop
  stats = {"seed": seed}
  os.makedirs(output_dir, exist_ok=True)
  for split, name in zip(("train", "validation"), PUBLIC_FILES):
    text_corpus.write_documents(os.path.join(output_dir, name), docs[split])
    n_q = sum(d in queries for d in docs[split])
    stats[split] = dict(
        documents=len(docs[split]), passages=len(docs[split]) - n_q,
        queries=n_q, words=sum(len(d.split()) for d in docs[split]),
        characters=sum(len(d) for d in docs[split]))
  with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8",
            newline="\n") as f:
    f.write(_public_readme(stats, seed))
  return stats


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=None,
                      help=f"default: {DEFAULT_OUTPUT_DIR}, or "
                      f"{DEFAULT_PUBLIC_DIR} with --public_corpus")
  parser.add_argument("--seed", type=int, default=None,
                      help=f"default: {SEED}, or {PUBLIC_SEED} with "
                      "--public_corpus")
  parser.add_argument("--no_spm", action="store_true",
                      help="skip training the SentencePiece model")
  parser.add_argument("--public_corpus", action="store_true",
                      help="write the public pretraining corpus (JSONL) "
                      "instead of the sample")
  args = parser.parse_args(argv)
  if args.public_corpus:
    args.output_dir = args.output_dir or DEFAULT_PUBLIC_DIR
    generate_public_corpus(args.output_dir, seed=(
        PUBLIC_SEED if args.seed is None else args.seed))
  else:
    args.output_dir = args.output_dir or DEFAULT_OUTPUT_DIR
    generate(args.output_dir, seed=SEED if args.seed is None else args.seed,
             train_spm=not args.no_spm)
  with open(os.path.join(args.output_dir, "README.md"), encoding="utf-8") as f:
    print(f.read())


if __name__ == "__main__":
  main()
