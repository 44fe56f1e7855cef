"""SMCalFlow 2.0 and TreeDST readers and the seqio tasks of the semantic-parsing
experiments ("Privacy-Preserving Domain Adaptation of Semantic Parsers").

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
turn's `lispress`, linearized (`dpjax.semparse.lispress.linearize`).

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

Readers are pure Python (no TensorFlow); seqio/TF are imported when a task is
registered.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from typing import Iterable, Iterator, Mapping, Sequence

import gin

from dpjax.semparse import lispress
from tasks import malformed
from tasks.malformed import MalformedLineError  # noqa: F401  (re-exported)

_MODULE_DIR = os.path.dirname(os.path.abspath(__file__))
_DATA_DIR = os.path.join(_MODULE_DIR, "data")

DATASETS = ("smcalflow", "treedst")
DEFAULT_DATA_DIRS = {
    "smcalflow": os.path.join(_DATA_DIR, "smcalflow_sample"),
    "treedst": os.path.join(_DATA_DIR, "treedst_sample"),
}
DEFAULT_VOCAB_DIR = os.path.join(_DATA_DIR, "semparse_vocab")
DEFAULT_BPE_VOCAB_PATH = os.path.join(DEFAULT_VOCAB_DIR, "vocab.json")
DEFAULT_BPE_MERGES_PATH = os.path.join(DEFAULT_VOCAB_DIR, "merges.txt")
DEFAULT_SENTENCEPIECE_PATH = os.path.join(DEFAULT_VOCAB_DIR,
                                          "semparse_sample.model")

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

# Task kind -> its example texts. Decoder-only kinds feed GPT-2 (prompt
# "inputs" + "targets"); "parser" feeds T5.
KINDS = {
    "utterance_lm": "1-stage: inputs '', targets utterance",
    "domain_to_utterance": "1.5-stage: inputs domain prompt, targets utterance",
    "parse_lm": "2-stage, stage 1: inputs '', targets linearized program",
    "parse_to_utterance": ("2-stage, stage 2: inputs program prompt, targets "
                           "utterance"),
    "parser": "T5 parser: inputs utterance, targets linearized program",
}
DATASET_KINDS = {
    "smcalflow": ("utterance_lm", "parse_lm", "parse_to_utterance", "parser"),
    "treedst": ("utterance_lm", "domain_to_utterance", "parse_lm",
                "parse_to_utterance", "parser"),
}


@dataclasses.dataclass(frozen=True)
class Turn:
  """One human turn: an (utterance, program) example."""

  dialogue_id: str
  turn_index: int
  utterance: str
  program: str  # linearized Lispress
  function_types: tuple[str, ...]
  domain: str | None  # TreeDST only


def domain_prompt(domain: str) -> str:
  """The 1.5-stage prompt; the generated utterance follows it."""
  return f"domain: {domain}\nutterance:"


def parse_prompt(program: str) -> str:
  """The 2-stage (parse -> utterance) prompt for a linearized program."""
  return f"parse: {program}\nutterance:"


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
  try:
    dialogue = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"not valid JSON ({e.msg} at character {e.pos + 1})") from e
  if not isinstance(dialogue, dict):
    raise ValueError(f"expected a JSON object, got {type(dialogue).__name__}")
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

  `data_dir` None means the embedded sample of `dataset`.
  """
  if dataset not in DATASETS:
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
  path = split_path(data_dir or DEFAULT_DATA_DIRS[dataset], split)
  return list(read_turns(path, on_malformed=on_malformed,
                         with_domains=dataset == "treedst"))


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
  import numpy as np  # pylint: disable=g-import-not-at-top

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


# ---------------------------------------------------------------------------
# seqio tasks.
# ---------------------------------------------------------------------------


def _texts(turn: Turn, kind: str) -> tuple[str, str]:
  """(inputs, targets) of one example of `kind`."""
  if kind == "utterance_lm":
    return "", turn.utterance
  if kind == "domain_to_utterance":
    return domain_prompt(turn.domain), turn.utterance
  if kind == "parse_lm":
    return "", turn.program
  if kind == "parse_to_utterance":
    return parse_prompt(turn.program), turn.utterance
  return turn.utterance, turn.program  # parser


def _examples_dataset(turns: list[Turn], kind: str, with_domain: bool):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  n = len(turns)
  texts = [_texts(t, kind) for t in turns]
  features = {
      "inputs": tf.constant([i for i, _ in texts], tf.string, shape=[n]),
      "targets": tf.constant([t for _, t in texts], tf.string, shape=[n]),
      "dialogue_id": tf.constant([t.dialogue_id for t in turns], tf.string,
                                 shape=[n]),
      "turn_index": np.array([t.turn_index for t in turns], np.int64),
  }
  if with_domain:
    features["domain"] = tf.constant([t.domain for t in turns], tf.string,
                                     shape=[n])
  return tf.data.Dataset.from_tensor_slices(features)


def _bpe_vocabulary(vocab_path: str, merges_path: str):
  from dpjax.data import vocabularies  # pylint: disable=g-import-not-at-top

  return vocabularies.ByteLevelBPEVocabulary(vocab_path, merges_path)


def _sentencepiece_vocabulary(path: str):
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f"SentencePiece model not found: {path!r}")
  return seqio.SentencePieceVocabulary(path)


def register_semparse_task(name: str, dataset: str, kind: str, *,
                           data_dir: str | None = None,
                           vocabulary=None,
                           portion: str = "all",
                           exclude_functions: Sequence[str] = (),
                           split_seed: int = 0,
                           public_fraction: float = PUBLIC_FRACTION,
                           on_malformed: str = "fail"):
  """Registers (or re-registers) one semantic-parsing seqio Task.

  Examples (one per human turn, see the module docstring) have the text
  features of `KINDS[kind]`, plus passthrough `dialogue_id` (string),
  `turn_index` (int64) and, for TreeDST, `domain` (string). Splits "train"
  and "validation". Preprocessing: tokenize, then EOS after trimming where
  the feature adds one. Decoder-only kinds: `inputs` add no EOS (the prompt,
  possibly empty), `targets` do; the model's feature converter prepends BOS
  and masks the prompt out of the loss. "parser": both features end in EOS.

  Files are read when a dataset is requested (registration only checks that
  they exist), so registering costs nothing for runs that use other tasks.

  Args:
    name: registry name; a task already registered under it is replaced.
    dataset: "smcalflow" or "treedst".
    kind: a key of `DATASET_KINDS[dataset]`.
    data_dir: the dataset directory; None means the embedded sample.
    vocabulary: a seqio vocabulary; None means the embedded sample's GPT-2
      BPE (decoder-only kinds) or SentencePiece model ("parser").
    portion: "all", "public" or "private" (see the module docstring); the
      same portion is taken of both splits, so "public" validation is the
      paper's 1/10 test subsample.
    exclude_functions: drop from the TRAIN split every example whose program
      calls a function matching one of these (`drop_functions`), e.g. the
      paper's D_pub without Weather; validation keeps them, so the missing
      functionality can be measured.
    split_seed: seed of the public/private split.
    public_fraction: size of the public portion.
    on_malformed: "fail" or "skip" (see `read_turns`).

  Returns:
    The registered `seqio.Task`.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top

  if dataset not in DATASETS:
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
  if kind not in DATASET_KINDS[dataset]:
    raise ValueError(f"{dataset} has task kinds {DATASET_KINDS[dataset]}, "
                     f"got {kind!r}")
  if portion not in PORTIONS:
    raise ValueError(f"portion must be one of {PORTIONS}, got {portion!r}")
  if on_malformed not in ("fail", "skip"):
    raise ValueError(f"on_malformed must be 'fail' or 'skip', got {on_malformed!r}")
  data_dir = data_dir or DEFAULT_DATA_DIRS[dataset]
  splits = tuple(SPLIT_FILES)
  for split in splits:
    split_path(data_dir, split)  # fail fast on a wrong directory
  if isinstance(exclude_functions, str):
    raise TypeError("exclude_functions must be a sequence of names, not a str")
  exclude = tuple(exclude_functions)
  if vocabulary is None:
    vocabulary = (_sentencepiece_vocabulary(DEFAULT_SENTENCEPIECE_PATH)
                  if kind == "parser" else
                  _bpe_vocabulary(DEFAULT_BPE_VOCAB_PATH, DEFAULT_BPE_MERGES_PATH))

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
    turns = select_portion(
        load_turns(dataset, split, data_dir, on_malformed=on_malformed),
        portion, seed=split_seed, public_fraction=public_fraction)
    if split == "train" and exclude:
      turns = drop_functions(turns, exclude)
    if shuffle_files:
      turns = [turns[i] for i in np.random.default_rng(seed).permutation(len(turns))]
    return _examples_dataset(turns, kind, with_domain=dataset == "treedst")

  decoder_only = kind != "parser"
  output_features = {
      "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=not decoder_only,
                              required=True),
      "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True,
                               required=True),
  }
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn=dataset_fn, splits=splits),
      preprocessors=[
          seqio.preprocessors.tokenize,
          seqio.preprocessors.append_eos_after_trim,
      ],
      output_features=output_features,
      metric_fns=[],
  )


@gin.configurable(denylist=["checkpoint_tokenizer_files"])
def register_semparse_tasks(
    smcalflow_dir: str | None = None,
    treedst_dir: str | None = None,
    bpe_vocab_path: str | None = None,
    bpe_merges_path: str | None = None,
    sentencepiece_path: str | None = None,
    lm_portion: str = "all",
    parser_portion: str = "all",
    parser_exclude_functions: Sequence[str] = (),
    split_seed: int = 0,
    public_fraction: float = PUBLIC_FRACTION,
    on_malformed: str = "fail",
    checkpoint_tokenizer_files: Mapping[str, str] | None = None,
) -> list:
  """Registers `{dataset}_{kind}` for every kind of `DATASET_KINDS`.

  That is `smcalflow_utterance_lm`, `smcalflow_parse_lm`,
  `smcalflow_parse_to_utterance`, `smcalflow_parser`, and the same for
  `treedst_` plus `treedst_domain_to_utterance`. For other combinations
  (e.g. a public parser without Weather next to the full one) call
  `register_semparse_task` with a name of your own.

  Args:
    smcalflow_dir, treedst_dir: dataset directories; None means the embedded
      samples.
    bpe_vocab_path, bpe_merges_path: GPT-2 `vocab.json` / `merges.txt` of the
      decoder-only tasks; None means the pretrained checkpoint's
      (`checkpoint_tokenizer_files`, passed by the trainer) if it has them,
      else the embedded sample's.
    sentencepiece_path: SentencePiece model of the parser tasks (pad 0, eos 1);
      None means the checkpoint's `spiece.model` if any, else the sample's.
    lm_portion: portion of the decoder-only (generation) tasks.
    parser_portion, parser_exclude_functions: portion and train-split
      function filter of the parser tasks.
    split_seed, public_fraction, on_malformed: see `register_semparse_task`.
    checkpoint_tokenizer_files: `dpjax.pretrained.tokenizer_files` of the
      pretrained checkpoint, if any.

  Returns:
    The registered tasks.
  """
  from dpjax.data import vocabularies  # pylint: disable=g-import-not-at-top
  files = dict(checkpoint_tokenizer_files or {})
  bpe = _bpe_vocabulary(*vocabularies.bpe_paths(
      bpe_vocab_path, bpe_merges_path, files,
      default_vocab=DEFAULT_BPE_VOCAB_PATH, default_merges=DEFAULT_BPE_MERGES_PATH))
  spm = _sentencepiece_vocabulary(sentencepiece_path or files.get(
      "sentencepiece") or DEFAULT_SENTENCEPIECE_PATH)
  dirs = {"smcalflow": smcalflow_dir, "treedst": treedst_dir}
  registered = []
  for dataset, kinds in DATASET_KINDS.items():
    for kind in kinds:
      parser = kind == "parser"
      registered.append(register_semparse_task(
          f"{dataset}_{kind}", dataset, kind, data_dir=dirs[dataset],
          vocabulary=spm if parser else bpe,
          portion=parser_portion if parser else lm_portion,
          exclude_functions=parser_exclude_functions if parser else (),
          split_seed=split_seed, public_fraction=public_fraction,
          on_malformed=on_malformed))
  return registered


__all__ = [
    "DATASETS", "DEFAULT_DATA_DIRS", "DEFAULT_BPE_VOCAB_PATH",
    "DEFAULT_BPE_MERGES_PATH", "DEFAULT_SENTENCEPIECE_PATH", "SPLIT_FILES",
    "PORTIONS", "PUBLIC_FRACTION", "PAPER_EXCLUSIONS", "TREEDST_DOMAIN_TYPES", "UNKNOWN_DOMAIN",
    "KINDS", "DATASET_KINDS", "Turn", "MalformedLineError", "domain_prompt",
    "parse_prompt", "treedst_domain", "read_turns", "split_path",
    "load_turns", "select_portion", "drop_functions", "write_dialogues",
    "register_semparse_task", "register_semparse_tasks",
]
