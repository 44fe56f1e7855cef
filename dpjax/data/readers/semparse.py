"""SMCalFlow 2.0 and TreeDST readers of the semantic-parsing experiments
("Privacy-Preserving Domain Adaptation of Semantic Parsers").

Files: Microsoft's dataflow-dialogue JSONL (`task_oriented_dialogue_as_dataflow
_synthesis`; TreeDST converted to the same format), one dialogue per line::

    {"dialogue_id": str, "turns": [{"turn_index": int,
      "user_utterance": {"original_text": str, "tokens": [str]},
      "agent_utterance": {"original_text": str, "tokens": [str],
                          "described_entities": [str]},
      "lispress": str, "skip": bool,
      "program_execution_oracle": {"has_exception": bool,
                                   "refer_are_correct": bool}}, ...]}

in `{train,valid}.dataflow_dialogues.jsonl` of a dataset directory (seqio split
"validation" reads `valid`). As in the paper (Sec. 4.1), dialogues are split
into single turns and only the human side is kept: each turn whose `skip` is
false gives one example `(user utterance, program)`; agent utterances are never
examples. The utterance is `user_utterance.original_text`; the program is the
turn's `lispress`, linearized (`dpjax.data.text.lispress.linearize`).

TreeDST domain of a turn (for the 1.5-stage baseline, 10 domains): the first
symbol of the program, in pre-order, whose type part (the text before the
first ".") is one of the domain types in `TREEDST_DOMAIN_TYPES`; so both
`(plan (^(Hotel) Find ...))` and `(Hotel.location_? ...)` give "hotel". A turn
whose program names no domain type (e.g. a bare confirmation) takes the domain
of the closest earlier turn of its dialogue, else of the closest later one,
else `UNKNOWN_DOMAIN`. Skipped turns' programs count as context.

Public/private split (paper Sec. 5.4): the public portion of a split is a
uniformly random subset of `round(public_fraction * n)` of its `n` turns (in
file order), drawn with `numpy.random.default_rng(seed)`; the private portion
is the rest. The split is a function of the files, the seed and the fraction
only, and it is made before any function filter, so D_priv keeps the examples
dropped from D_pub.

Pure Python and numpy (no TensorFlow); `tasks.semparse` registers the seqio
tasks built on these readers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import os
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from dpjax.data.readers import SAMPLE_DATA_DIR, malformed
from dpjax.data.readers.malformed import MalformedLineError  # noqa: F401  (raised)
from dpjax.data.text import lispress

DATASETS = ("smcalflow", "treedst")
DEFAULT_DATA_DIRS = {
    "smcalflow": os.path.join(SAMPLE_DATA_DIR, "smcalflow_sample"),
    "treedst": os.path.join(SAMPLE_DATA_DIR, "treedst_sample"),
}
SPLIT_FILES = {
    "train": "train.dataflow_dialogues.jsonl",
    "validation": "valid.dataflow_dialogues.jsonl",
}
PORTIONS = ("all", "public", "private")
PUBLIC_FRACTION = 0.1
# The functionality the paper removes from D_pub (Sec. 5.4), as
# `exclude_functions` patterns: Weather (WeatherQueryApi, WeatherAggregate,
# WeatherQuantifier.*, ...) and EventOnDate ("EoD").
PAPER_EXCLUSIONS = {"weather": ("Weather*",), "eod": ("EventOnDate",)}

# Type name in TreeDST programs -> domain label.
TREEDST_DOMAIN_TYPES = {
    "Flight": "flight", "Hotel": "hotel", "Restaurant": "restaurant",
    "Taxi": "taxi", "Train": "train", "Attraction": "attraction",
    "Message": "message", "Reminder": "reminder", "Navigation": "navigation",
    "Weather": "weather",
}
UNKNOWN_DOMAIN = "other"

@dataclasses.dataclass(frozen=True)
class Turn:
  """One human turn: an (utterance, program) example."""

  dialogue_id: str
  turn_index: int
  utterance: str
  program: str  # linearized Lispress
  function_types: tuple[str, ...]
  domain: str | None  # TreeDST only


def treedst_domain(program: str | lispress.Sexp,
                   domain_types: Mapping[str, str] = TREEDST_DOMAIN_TYPES
                   ) -> str | None:
  """The domain named by the program itself (see the module docstring)."""
  for name in lispress.symbols(program):
    domain = domain_types.get(name.split(".", 1)[0])
    if domain is not None:
      return domain
  return None


def _fill_domains(domains: list[str | None]) -> list[str]:
  """Turns without a domain take the closest earlier, else later, one."""
  known = [d for d in domains if d is not None]
  current = known[0] if known else UNKNOWN_DOMAIN
  out = []
  for d in domains:
    current = d if d is not None else current
    out.append(current)
  return out


def _require(obj: dict, key: str, kind: type, where: str):
  if key not in obj:
    raise ValueError(f"{where}missing field {key!r}")
  value = obj[key]
  if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
    raise ValueError(f"{where}field {key!r} must be {kind.__name__}, got "
                     f"{type(value).__name__}")
  return value


def _dialogue_turns(line: str, with_domains: bool,
                    domain_types: Mapping[str, str]) -> tuple[str, list[Turn]]:
  """(dialogue id, kept turns) of one JSONL line; ValueError says what is
  wrong."""
  dialogue = malformed.json_object(line)
  dialogue_id = _require(dialogue, "dialogue_id", str, "")
  raw_turns = _require(dialogue, "turns", list, "")
  parsed = []
  for k, turn in enumerate(raw_turns):
    where = f"turns[{k}]: "
    if not isinstance(turn, dict):
      raise ValueError(f"{where}expected a JSON object")
    index = _require(turn, "turn_index", int, where)
    user = _require(turn, "user_utterance", dict, where)
    text = _require(user, "original_text", str, where + "user_utterance: ")
    skip = _require(turn, "skip", bool, where)
    try:
      program = lispress.parse(_require(turn, "lispress", str, where))
      types = tuple(lispress.function_types(program))
    except lispress.LispressError as e:
      raise ValueError(f"{where}malformed lispress: {e}") from e
    if not skip and not text.strip():
      raise ValueError(f"{where}empty user utterance")
    parsed.append((index, text, skip, program, types))
  domains = ([None] * len(parsed) if not with_domains else _fill_domains(
      [treedst_domain(p, domain_types) for _, _, _, p, _ in parsed]))
  return dialogue_id, [
      Turn(dialogue_id, index, text, lispress.linearize(program), types, domain)
      for (index, text, skip, program, types), domain in zip(parsed, domains)
      if not skip]


def read_turns(path: str, *, on_malformed: str = "fail",
               with_domains: bool = False,
               domain_types: Mapping[str, str] = TREEDST_DOMAIN_TYPES
               ) -> Iterator[Turn]:
  """Streams the human turns of a dataflow-dialogue JSONL file.

  Args:
    path: a `*.dataflow_dialogues.jsonl` file.
    on_malformed: "fail" raises `MalformedLineError("path:line: reason")` for
      a line that is not UTF-8 or JSON, lacks a field the examples need
      (`dialogue_id`, `turns[].turn_index`, `turns[].user_utterance
      .original_text`, `turns[].lispress`, `turns[].skip`), has a field of the
      wrong type, a program that is not Lispress, an empty utterance in a
      kept turn, or repeats a dialogue id; "skip" drops such a line (the whole
      dialogue) and logs one warning with the count and the first location.
    with_domains: label each turn with its TreeDST domain.
    domain_types: type name -> domain label, for `with_domains`.

  Yields:
    The turns with `skip` false, in file order.
  """
  policy = malformed.MalformedPolicy(on_malformed, f"dialogues in {path}")
  seen: set[str] = set()
  try:
    for lineno, line in malformed.decoded_lines(path, policy):
      try:
        dialogue_id, turns = _dialogue_turns(line, with_domains, domain_types)
        if dialogue_id in seen:
          raise ValueError(f"duplicate dialogue_id {dialogue_id!r}")
      except ValueError as e:
        policy(path, lineno, str(e))
        continue
      seen.add(dialogue_id)
      yield from turns
  finally:
    policy.report()


def split_path(data_dir: str, split: str) -> str:
  """The JSONL file of a seqio split; checks that it exists."""
  if split not in SPLIT_FILES:
    raise ValueError(f"split must be one of {sorted(SPLIT_FILES)}, got {split!r}")
  path = os.path.join(data_dir, SPLIT_FILES[split])
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"Dataflow dialogue file not found: {path!r} (a dataset directory "
        f"holds {', '.join(SPLIT_FILES.values())})")
  return path


def load_turns(dataset: str, split: str, data_dir: str | None = None, *,
               on_malformed: str = "fail") -> list[Turn]:
  """All human turns of a split; TreeDST turns carry their domain.

  `data_dir` None means the embedded sample of `dataset`. A file is read
  once per version (its size, inode and modification time): a pipeline
  reads the same splits for every run it trains and every score it
  computes. So `on_malformed="skip"` warns at a version's first read only.
  """
  if dataset not in DATASETS:
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
  path = split_path(data_dir or DEFAULT_DATA_DIRS[dataset], split)
  stat = os.stat(path)
  return list(_read_version(path, on_malformed, dataset == "treedst",
                            stat.st_size, stat.st_ino, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _read_version(path: str, on_malformed: str, with_domains: bool,
                  *version: int) -> tuple[Turn, ...]:
  return tuple(read_turns(path, on_malformed=on_malformed,
                          with_domains=with_domains))


def write_dialogues(path: str, examples: Iterable[tuple[str, str]], *,
                    prefix: str = "synthetic") -> int:
  """Writes (utterance, program) pairs as a dataflow-dialogue JSONL file, one
  single-turn dialogue each (the format `read_turns` reads), so generated or
  re-labelled data feeds the same tasks as the published files. Programs
  are Lispress in any form `lispress.parse` reads; returns the count."""
  lines = []
  for i, (utterance, program) in enumerate(examples):
    turn = {"turn_index": 0,
            "user_utterance": {"original_text": utterance,
                               "tokens": utterance.split()},
            "agent_utterance": {"original_text": "", "tokens": [],
                                "described_entities": []},
            "lispress": lispress.render(program), "skip": False,
            "program_execution_oracle": {"has_exception": False,
                                         "refer_are_correct": True}}
    lines.append(json.dumps({"dialogue_id": f"{prefix}-{i}",
                             "turns": [turn]}) + "\n")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(lines)
  os.replace(tmp, path)
  return len(lines)


def select_portion(turns: Sequence[Turn], portion: str, *, seed: int = 0,
                   public_fraction: float = PUBLIC_FRACTION) -> list[Turn]:
  """The "all", "public" or "private" portion of `turns`, in their order."""
  if portion not in PORTIONS:
    raise ValueError(f"portion must be one of {PORTIONS}, got {portion!r}")
  if not 0.0 <= public_fraction <= 1.0:
    raise ValueError(f"public_fraction must be in [0, 1], got {public_fraction}")
  if portion == "all":
    return list(turns)
  n = len(turns)
  public = np.zeros(n, bool)
  public[np.random.default_rng(seed).permutation(n)[:round(public_fraction * n)]] = True
  keep = public if portion == "public" else ~public
  return [t for t, k in zip(turns, keep) if k]


def drop_functions(turns: Iterable[Turn], patterns: Sequence[str]
                   ) -> list[Turn]:
  """The turns whose program calls no function matching any pattern.

  Patterns are function types (`WeatherQueryApi`) or `fnmatch` shell patterns
  matched case-sensitively (`Weather*`, `EventOnDate*`).
  """
  patterns = tuple(patterns)
  return [t for t in turns
          if not any(fnmatch.fnmatchcase(f, p)
                     for f in t.function_types for p in patterns)]


__all__ = [
    "DATASETS", "DEFAULT_DATA_DIRS", "SPLIT_FILES", "PORTIONS",
    "PUBLIC_FRACTION", "PAPER_EXCLUSIONS", "TREEDST_DOMAIN_TYPES",
    "UNKNOWN_DOMAIN", "Turn", "MalformedLineError", "treedst_domain",
    "read_turns", "split_path", "load_turns", "write_dialogues",
    "select_portion", "drop_functions",
]
