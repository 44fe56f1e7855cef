"""AirDialogue and Europarl readers and SeqPATE's sentence-completion examples
("SeqPATE: Differentially Private Text Generation via Knowledge
Distillation", App. E-G).

Files:

* AirDialogue (the google/airdialogue release, `{train,dev}_data.json`): one
  JSON object per line::

      {"intent": {"name": "Jacob Walker", "departure_airport": "EWR", ...},
       "action": {"status": "book", "name": "Jacob Walker", "flight": [1003]},
       "expected_action": {...}, "timestamps": [int], "search_info": [...],
       "correct_sample": bool,
       "dialogue": ["customer: Hi.", "agent: Hello. How can I help?", ...]}

  Every utterance, customer's and agent's, is a sentence (App. E); its text
  is what follows the "customer:" / "agent:" speaker tag. The user id is the
  customer's full name `intent.name`: the release has no other customer
  identifier, and the paper partitions by user and takes the user's full
  name as the secret phrase (App. F). The reader needs only `intent.name`
  and `dialogue`; the other fields (and the `*_kb.json` files) are ignored.
* Europarl (WMT11's monolingual `europarl-v6.en`): one sentence per line,
  UTF-8; no user ids, so only sample-level partitioning applies.

Sentence completion (App. E, G): sentences of fewer than 8 tokens are
dropped, the rest truncated to 40 tokens, and the first 4 tokens are the
prefix the model completes. The paper's tokens are whitespace-separated
words: its prefixes (Table 14: "As of your requirements,", "Yes, I would
like", "I am Janet Miller.") are 4 words each and not 4 GPT-2 BPE tokens. These
rules therefore count words here too; the model sees the BPE tokens of the
same text (`encode_completions`).

Splits (`completion_splits`, the table's and the seqio task's): AirDialogue's
users of `train_data.json` split into public (a fraction of them) and
private, so no private user's sentence is public, the test set being
`dev_data.json`; Europarl (no users) split by sentence into private /
public / test.

Pure Python and numpy (no TensorFlow); `tasks.seqpate` registers the seqio
task of a private split.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from dpjax.data.readers import SAMPLE_DATA_DIR, malformed
from dpjax.data.readers.malformed import MalformedLineError  # noqa: F401  (raised)

_DATA_DIR = os.path.join(SAMPLE_DATA_DIR, "seqpate_sample")
DEFAULT_AIRDIALOGUE_DIR = os.path.join(_DATA_DIR, "airdialogue")
DEFAULT_EUROPARL_PATH = os.path.join(_DATA_DIR, "europarl", "europarl-v6.en")
DEFAULT_VOCAB_DIR = os.path.join(_DATA_DIR, "vocab")
AIRDIALOGUE_FILES = {"train": "train_data.json", "dev": "dev_data.json"}
SPEAKERS = ("customer", "agent")

PREFIX_WORDS = 4
MIN_WORDS = 8
MAX_WORDS = 40


@dataclasses.dataclass(frozen=True)
class Sentence:
  """One sentence of a corpus; `where` is `path:line` (AirDialogue adds the
  utterance index: `path:line:turn`)."""
  text: str
  user_id: str | None
  where: str


def _dialogue_sentences(line: str) -> tuple[str, list[tuple[str, str]]]:
  """(user id, [(speaker, text)]) of one AirDialogue line; ValueError says
  what is wrong."""
  record = malformed.json_object(line)
  intent = record.get("intent")
  if not isinstance(intent, dict) or not isinstance(intent.get("name"), str):
    raise ValueError("missing string field 'intent.name' (the customer)")
  if not intent["name"].strip():
    raise ValueError("empty 'intent.name'")
  dialogue = record.get("dialogue")
  if not isinstance(dialogue, list):
    raise ValueError("missing list field 'dialogue'")
  turns = []
  for k, turn in enumerate(dialogue):
    if not isinstance(turn, str):
      raise ValueError(f"dialogue[{k}] must be a string")
    speaker, sep, text = turn.partition(":")
    if not sep or speaker.strip() not in SPEAKERS:
      raise ValueError(f"dialogue[{k}] does not start with 'customer:' or "
                       f"'agent:': {turn[:40]!r}")
    turns.append((speaker.strip(), text.strip()))
  return intent["name"].strip(), turns


def read_airdialogue(path: str, *, on_malformed: str = "fail"
                     ) -> Iterator[Sentence]:
  """Streams the utterances of an AirDialogue `*_data.json` file.

  `on_malformed`: "fail" raises `MalformedLineError("path:line: reason")` for
  a line that is not UTF-8 or JSON, lacks `intent.name` or `dialogue`, or
  has an utterance without a speaker tag; "skip" drops such a dialogue and
  logs one warning with the count and the first location.
  """
  policy = malformed.MalformedPolicy(on_malformed, f"dialogues in {path}")
  try:
    for lineno, line in malformed.decoded_lines(path, policy):
      try:
        user, turns = _dialogue_sentences(line)
      except ValueError as e:
        policy(path, lineno, str(e))
        continue
      for k, (_, text) in enumerate(turns):
        if text:
          yield Sentence(text, user, f"{path}:{lineno}:{k}")
  finally:
    policy.report()


def read_europarl(path: str, *, on_malformed: str = "fail"
                  ) -> Iterator[Sentence]:
  """Streams the sentences (non-blank lines) of a Europarl text file.

  `on_malformed`: "fail" raises `MalformedLineError` on invalid UTF-8;
  "skip" skips such lines and logs one warning.
  """
  policy = malformed.MalformedPolicy(on_malformed, f"lines in {path}")
  try:
    for lineno, line in malformed.decoded_lines(path, policy):
      yield Sentence(line.strip(), None, f"{path}:{lineno}")
  finally:
    policy.report()


def load_airdialogue(split: str = "train", data_dir: str | None = None, *,
                     on_malformed: str = "fail") -> list[Sentence]:
  """The utterances of a split ("train" or "dev"); default: the sample."""
  if split not in AIRDIALOGUE_FILES:
    raise ValueError(f"split must be one of {sorted(AIRDIALOGUE_FILES)}, "
                     f"got {split!r}")
  path = os.path.join(data_dir or DEFAULT_AIRDIALOGUE_DIR,
                      AIRDIALOGUE_FILES[split])
  if not os.path.isfile(path):
    raise FileNotFoundError(f"AirDialogue file not found: {path!r}")
  return list(read_airdialogue(path, on_malformed=on_malformed))


def load_europarl(path: str | None = None, *,
                  on_malformed: str = "fail") -> list[Sentence]:
  """The sentences of a Europarl file; default: the sample."""
  path = path or DEFAULT_EUROPARL_PATH
  if not os.path.isfile(path):
    raise FileNotFoundError(f"Europarl file not found: {path!r}")
  return list(read_europarl(path, on_malformed=on_malformed))


@dataclasses.dataclass(frozen=True)
class Completion:
  """A sentence-completion example: `text` (at most `MAX_WORDS` words,
  single-spaced) starts with `prefix` (its first `PREFIX_WORDS` words)."""
  prefix: str
  text: str
  user_id: str | None


def completion_examples(sentences: Iterable[Sentence], *,
                        prefix_words: int = PREFIX_WORDS,
                        min_words: int = MIN_WORDS,
                        max_words: int = MAX_WORDS) -> list[Completion]:
  """Drops sentences under `min_words` words, truncates to `max_words`."""
  if not 0 < prefix_words < min_words <= max_words:
    raise ValueError("need 0 < prefix_words < min_words <= max_words, got "
                     f"{prefix_words}, {min_words}, {max_words}.")
  out = []
  for s in sentences:
    words = s.text.split()
    if len(words) >= min_words:
      out.append(Completion(" ".join(words[:prefix_words]),
                            " ".join(words[:max_words]), s.user_id))
  return out


def split_examples(examples: Sequence, fractions: Mapping[str, float],
                   seed: int) -> dict[str, list]:
  """Disjoint random portions (e.g. {"private": 0.9, "public": 0.1}) of
  `round(f * n)` examples each, in their original order; the last portion
  takes the rounding remainder if the fractions sum to 1."""
  total = sum(fractions.values())
  if any(f < 0 for f in fractions.values()) or total > 1 + 1e-9:
    raise ValueError(f"fractions must be >= 0 and sum to at most 1, got "
                     f"{dict(fractions)}")
  n = len(examples)
  order = np.random.default_rng(seed).permutation(n)
  bounds = np.round(np.cumsum([0.0] + list(fractions.values())) * n).astype(int)
  if abs(total - 1) <= 1e-9:
    bounds[-1] = n
  return {name: [examples[i] for i in np.sort(order[lo:hi])]
          for name, lo, hi in zip(fractions, bounds[:-1], bounds[1:])}


def encode_completions(examples: Sequence[Completion], vocabulary,
                       length: int) -> dict[str, np.ndarray]:
  """GPT-2 arrays of the examples: row `[BOS] + BPE(text) + [EOS]`, cut at
  `length` and right-padded with EOS (BOS = EOS, GPT-2's convention).

  `vocabulary`: anything with `encode(str) -> list[int]` and `eos_id` (a
  `dpjax.data.vocabularies.ByteLevelBPEVocabulary`, e.g. `sample_vocabulary()`).

  Returns {"tokens": [n, L] int32, "loss_weights": [n, L] float32 (1 on
  every token after BOS, the final EOS included if it fits), "prefix_lengths":
  [n] int32 (BOS + the prefix's tokens: the prompt of a completion)}.
  """
  eos = vocabulary.eos_id
  tokens = np.full((len(examples), length), eos, np.int32)
  weights = np.zeros((len(examples), length), np.float32)
  prefix_lengths = np.zeros(len(examples), np.int32)
  for i, ex in enumerate(examples):
    ids = [eos] + list(vocabulary.encode(ex.text)) + [eos]
    prefix = list(vocabulary.encode(ex.prefix))
    # GPT-2's pre-tokenizer splits before each " word", so a single-spaced
    # text's tokens start with its prefix's.
    if ids[1:1 + len(prefix)] != prefix:
      raise ValueError(f"example {i}: the tokens of {ex.text!r} do not start "
                       f"with those of its prefix {ex.prefix!r}")
    if len(prefix) + 1 >= length:
      raise ValueError(f"example {i}: length {length} leaves no room after "
                       f"the prefix {ex.prefix!r} ({len(prefix)} tokens)")
    ids = ids[:length]
    tokens[i, :len(ids)] = ids
    weights[i, 1:len(ids)] = 1.0
    prefix_lengths[i] = 1 + len(prefix)
  return {"tokens": tokens, "loss_weights": weights,
          "prefix_lengths": prefix_lengths}


DATASETS = ("airdialogue", "europarl")


def completion_splits(dataset: str, seed: int, *, public_fraction: float,
                      test_fraction: float) -> dict[str, list[Completion]]:
  """{"private", "public", "test"}: the completion examples of the embedded
  sample's `dataset` split by `seed` (module docstring); `test_fraction` is
  Europarl's only."""
  if dataset == "airdialogue":
    train = completion_examples(load_airdialogue("train"))
    users = sorted({e.user_id for e in train})
    order = np.random.default_rng(seed).permutation(len(users))
    public = {users[i] for i in order[:round(public_fraction * len(users))]}
    return {"private": [e for e in train if e.user_id not in public],
            "public": [e for e in train if e.user_id in public],
            "test": completion_examples(load_airdialogue("dev"))}
  if dataset == "europarl":
    return split_examples(
        completion_examples(load_europarl()),
        {"public": public_fraction, "test": test_fraction,
         "private": 1 - public_fraction - test_fraction}, seed)
  raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


__all__ = [
    "AIRDIALOGUE_FILES", "DATASETS", "DEFAULT_AIRDIALOGUE_DIR",
    "DEFAULT_EUROPARL_PATH", "DEFAULT_VOCAB_DIR", "MAX_WORDS", "MIN_WORDS",
    "PREFIX_WORDS", "SPEAKERS", "Completion", "MalformedLineError",
    "Sentence", "completion_examples", "completion_splits",
    "encode_completions", "load_airdialogue", "load_europarl",
    "read_airdialogue", "read_europarl", "split_examples",
]
