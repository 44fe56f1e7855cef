"""Redaction policies. Keyword redaction is checked on hand-written examples
and against a brute-force n-gram matcher; the classifier policy's windows and
merging against hand computations with a stub scorer."""
import json
import random
import re

import numpy as np
import pytest

from dpjax.data.readers import multidogo
from dpjax.data.text import redaction
from dpjax.data.text.redaction import REDACTED as R

PHRASES = {
    "AIRLINE": ["seat", "window seat", "booking confirmation", "confirmation number",
                "seat number allotted", "Skylark Airways"],
    "MEDIA": ["data plan", "zip code"],
    "INSURANCE": ["claim", "policy number"],
}


@pytest.fixture(scope="module")
def keywords():
  return redaction.KeywordPolicy(PHRASES)


@pytest.mark.parametrize("text,expected", [
    # case-insensitive; punctuation next to a match stays
    ("My WINDOW Seat, please.", f"My {R} {R}, please."),
    # overlapping phrases: the words of both are private
    ("share the booking confirmation number now", f"share the {R} {R} {R} now"),
    # whitespace between words is kept, any run of it matches
    ("a window  seat\nor Skylark\tAirways", f"a {R}  {R}\nor {R}\t{R}"),
    # no partial-word matches
    ("seats reseat seating carseat claims", "seats reseat seating carseat claims"),
    # punctuation adjacency on either side
    ("(seat) seat. seat's claim-form [zip code]",
     f"({R}) {R}. {R}'s {R}-form [{R} {R}]"),
    ("", ""),
])
def test_keyword_redaction(keywords, text, expected):
  assert keywords.redact(text) == expected
  assert keywords.flags(text) == (expected != text)


def test_keyword_longest_phrase_first(keywords):
  # "window seat" wins over the "seat" inside it: one span over both words.
  assert keywords.spans("a window  seat") == [(2, 14)]
  assert keywords.spans("seat window") == [(0, 4)]
  # "seat number allotted" is tried before its prefix "seat".
  assert keywords.redact("your seat number allotted today") == f"your {R} {R} {R} today"
  # Overlapping matches merge into one span.
  assert keywords.spans("booking confirmation number") == [(0, 27)]


def test_keyword_domains(keywords):
  text = "your zip code and claim for seat 4A"
  assert keywords.redact(text, ["MEDIA"]) == f"your {R} {R} and claim for seat 4A"
  assert keywords.redact(text, ["INSURANCE", "AIRLINE"]) == (
      f"your zip code and {R} for {R} 4A")
  assert not keywords.flags("my data plan", ["AIRLINE", "INSURANCE"])
  assert not keywords.flags("seat", [])
  assert keywords.flags_batch(["my data plan", "hello"], ["MEDIA"]) == [True, False]
  with pytest.raises(ValueError, match="unknown domains"):
    keywords.flags("x", ["FINANCE"])
  with pytest.raises(TypeError):
    keywords.flags("x", "MEDIA")
  only_media = redaction.KeywordPolicy(PHRASES, domains=["MEDIA"])
  assert only_media.domains == ("MEDIA",)
  assert only_media.redact("seat and zip code") == f"seat and {R} {R}"


_WORDS = ["seat", "Window", "seats", "pass", "boarding", "BOARDING", "the",
          "reseat", "number", "confirmation"]
_SEPARATORS = [" ", "  ", "\n", ", ", ".", "-", "'", " (", ") "]
_RANDOM_PHRASES = {"X": ["seat", "window seat", "boarding pass", "pass",
                         "confirmation number", "the boarding", "seat number",
                         "pass the boarding"]}


def _brute_force_redact(text, phrases):
  """Word tokens (\\w+) of the text; a phrase occurs where its tokens follow
  one another, case-insensitively, with only whitespace between them; every
  covered run of non-whitespace characters becomes one REDACTED."""
  tokens = [(m.start(), m.end(), m.group().lower()) for m in re.finditer(r"\w+", text)]
  covered = np.zeros(len(text) + 1, bool)
  for phrase in phrases:
    words = phrase.lower().split()
    for i in range(len(tokens) - len(words) + 1):
      window = tokens[i:i + len(words)]
      gaps = [text[a[1]:b[0]] for a, b in zip(window, window[1:])]
      if [t[2] for t in window] == words and all(g and not g.strip() for g in gaps):
        covered[window[0][0]:window[-1][1]] = True
  out, i = [], 0
  while i < len(text):
    if covered[i] and not text[i].isspace():
      while covered[i] and not text[i].isspace():
        i += 1
      out.append(R)
    else:
      out.append(text[i])
      i += 1
  return "".join(out)


def test_keyword_matches_brute_force():
  policy = redaction.KeywordPolicy(_RANDOM_PHRASES)
  rng = random.Random(0)
  for _ in range(300):
    n = rng.randint(0, 12)
    text = "".join(rng.choice(_WORDS) + rng.choice(_SEPARATORS) for _ in range(n))
    expected = _brute_force_redact(text, _RANDOM_PHRASES["X"])
    redacted = policy.redact(text)
    assert redacted == expected, text
    assert policy.flags(text) == (expected != text)
    assert not policy.flags(redacted)  # the completeness guarantee
    assert len(redacted.split()) == len(text.split())  # whitespace untouched


def test_keyword_json(tmp_path):
  path = tmp_path / "k.json"
  path.write_text(json.dumps(PHRASES))
  policy = redaction.KeywordPolicy.from_json(str(path), domains=["AIRLINE"])
  assert policy.domains == ("AIRLINE",)
  assert policy.redact("Skylark airways seat") == f"{R} {R} {R}"
  for bad, reason in [("{not json", ":1: not valid JSON"),
                      ('["seat"]', "expected a JSON object"),
                      ('{"A": "seat"}', "expected a JSON object"),
                      ('{"A": ["seat", ""]}', "non-empty strings"),
                      ('{"A": ["the REDACTED part"]}', "would match")]:
    path.write_text(bad)
    with pytest.raises(ValueError, match=re.escape(reason)):
      redaction.KeywordPolicy.from_json(str(path))
  with pytest.raises(FileNotFoundError):
    redaction.KeywordPolicy.from_json(str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match="subset"):
    redaction.KeywordPolicy(PHRASES, domains=["FINANCE"])


def test_sample_keywords_load():
  policy = redaction.KeywordPolicy.from_json(multidogo.DEFAULT_KEYWORDS_PATH)
  assert set(policy.domains) == set(multidogo.PAPER_DOMAINS)
  assert policy.redact("Your boarding pass is ready") == f"Your {R} {R} is ready"


# ---------------------------------------------------------------------------
# Classifier policy with a stub scorer.
# ---------------------------------------------------------------------------


class StubScorer:
  """P(A) = 0.95 for a window containing the word "secret", 0.9 if it
  contains "borderline", else 0.5; P(B) = 1 - P(A). Records its calls."""

  def __init__(self):
    self.calls = []

  def __call__(self, windows):
    self.calls.append(list(windows))
    p = [0.95 if "secret" in w.split() else 0.9 if "borderline" in w.split() else 0.5
         for w in windows]
    return np.array([[x, 1 - x] for x in p])


def _words(n, secret_at=()):
  return ["secret" if i in secret_at else f"w{i}" for i in range(n)]


def test_classifier_policy_windows_and_merging():
  scorer = StubScorer()
  policy = redaction.ClassifierPolicy(scorer, ["A", "B"], threshold=0.9,
                                      window_words=16, stride=8)
  long_text = " ".join(_words(40, secret_at={21}))
  short_text = "a  b\nsecret c"
  texts = [long_text, short_text, "", "borderline case"]
  redacted = policy.redact_batch(texts)
  # 40 words, windows of 16 at stride 8 start at 0, 8, 16, 24; word 21 is in
  # the windows starting at 8 and 16, so words 8..31 are private.
  words = _words(40, secret_at={21})
  assert redacted[0] == " ".join(words[:8] + [R] * 24 + words[32:])
  assert redacted[1] == f"{R}  {R}\n{R} {R}"  # one window; whitespace kept
  assert redacted[2] == ""
  assert redacted[3] == "borderline case"  # 0.9 is not > 0.9
  # One scorer call for the whole batch, windows as single-spaced words.
  assert len(scorer.calls) == 1
  assert scorer.calls[0][1] == " ".join(words[8:24])
  assert scorer.calls[0][4] == "a b secret c"
  assert len(scorer.calls[0]) == 4 + 1 + 1
  # The private words form one span from word 8's start to word 31's end.
  start = len(" ".join(words[:8])) + 1
  assert policy.spans(long_text) == [(start, start + len(" ".join(words[8:32])))]
  assert not policy.flags(long_text, ["B"])
  assert not policy.flags(long_text, [])  # no domains: nothing is private


def test_classifier_policy_stride_and_separate_runs():
  policy = redaction.ClassifierPolicy(StubScorer(), ["A", "B"], window_words=4,
                                      stride=4)
  # 10 words, windows at 0, 4 and the last one at 6; "secret" at 1 and 9 flags
  # windows 0 (words 0..3) and 6 (words 6..9): two separate runs.
  words = _words(10, secret_at={1, 9})
  text = " ".join(words)
  assert redaction.word_windows(10, 4, 4) == [0, 4, 6]
  assert policy.redact(text) == " ".join([R] * 4 + words[4:6] + [R] * 4)
  assert len(policy.spans(text)) == 2
  assert policy.flags(text, ["A"]) and not policy.flags(text, ["B"])


def test_word_windows():
  assert redaction.word_windows(0, 16, 8) == []
  assert redaction.word_windows(5, 16, 8) == [0]
  assert redaction.word_windows(16, 16, 8) == [0]
  assert redaction.word_windows(17, 16, 8) == [0, 1]
  assert redaction.word_windows(40, 16, 8) == [0, 8, 16, 24]
  with pytest.raises(ValueError):
    redaction.word_windows(3, 16, 0)
