"""Redaction policies: which words of a text are sensitive to which domain.

A policy function (Kabra & Elenberg, "Domain Private Transformers", Sec. 5.1;
Shi et al.'s policy functions) marks the private words of a text. dpjax uses
a policy two ways: to build a redacted training set (each private word
becomes `REDACTED`), and, in the LiRa attack, to ask whether a generation
contains anything of domain D (`flags(text, domains=[D])`).

Two policies:

* `KeywordPolicy`: per-domain phrase lists (the paper's "Keyword Detection").
  A phrase matches case-insensitively, as whole words (never inside a longer
  word; punctuation next to it does not prevent a match), with any run of
  whitespace between its words.
* `ClassifierPolicy`: a domain classifier scores every window of
  `window_words` consecutive words (the paper's "Sequence Classification":
  flag if some window t* has Pr[h(t*) = d] > z); the words of the flagged
  windows are private.

Words are maximal runs of non-whitespace. Redaction replaces each private word
by one `REDACTED` token, as in the paper's examples ("booking confirmation
number" -> three tokens), keeping the whitespace between words, so a redacted
text has as many words as the original. A keyword match that ends inside a
whitespace-delimited word keeps the rest of that word ("seat," -> "<REDACTED>,").

Policies see plain text: callers redact utterances before adding control
tokens (`<_soc_>`, `SYS:`, `<AIRLINE>`, ...), which must stay visible.

Pure text logic (numpy only): the data layer (`dpjax.data.readers`, `tasks`)
redacts with these policies, and the classifier policy's model comes from
above (`dpjax.pipelines.dialog.classifier.classifier_policy` wraps a trained one).
"""
from __future__ import annotations

import abc
import json
import os
import re
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

REDACTED = "<REDACTED>"
Span = tuple[int, int]  # [start, end) character offsets
_WORD = re.compile(r"\S+")


def merge_spans(spans: Iterable[Span]) -> list[Span]:
  """Sorted union of [start, end) spans; overlapping or touching ones merge."""
  merged: list[list[int]] = []
  for start, end in sorted(spans):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return [(s, e) for s, e in merged]


def redact_spans(text: str, spans: Iterable[Span]) -> str:
  """`text` with every word (non-whitespace run) inside a span, clipped to the
  span, replaced by `REDACTED`."""
  out, pos = [], 0
  for start, end in merge_spans(spans):
    for m in _WORD.finditer(text, start, end):
      out += [text[pos:m.start()], REDACTED]
      pos = m.end()
  out.append(text[pos:])
  return "".join(out)


def word_windows(n_words: int, window_words: int, stride: int) -> list[int]:
  """Start indices of the windows over `n_words` words: every `stride`-th,
  plus one ending at the last word; a text shorter than a window is one
  window."""
  if window_words < 1 or stride < 1:
    raise ValueError(f"window_words and stride must be >= 1, got "
                     f"{window_words}, {stride}")
  if n_words == 0:
    return []
  last = max(n_words - window_words, 0)
  starts = list(range(0, last + 1, stride))
  if starts[-1] != last:
    starts.append(last)
  return starts


class Policy(abc.ABC):
  """Marks the words of a text that are sensitive to some of `domains`.

  Subclasses implement `spans_batch`; the other methods derive from it.
  `domains=None` anywhere means all of the policy's domains.
  """

  domains: tuple[str, ...]

  @abc.abstractmethod
  def spans_batch(self, texts: Sequence[str],
                  domains: Sequence[str] | None = None) -> list[list[Span]]:
    """Per text: the sorted, merged character spans private to `domains`."""

  def spans(self, text: str, domains: Sequence[str] | None = None
            ) -> list[Span]:
    """The sorted, merged character spans of `text` private to `domains`."""
    return self.spans_batch([text], domains)[0]

  def flags(self, text: str, domains: Sequence[str] | None = None) -> bool:
    """Whether `text` contains anything private to one of `domains`."""
    return bool(self.spans(text, domains))

  def flags_batch(self, texts: Sequence[str],
                  domains: Sequence[str] | None = None) -> list[bool]:
    """Per text: whether it contains anything private to `domains`."""
    return [bool(s) for s in self.spans_batch(texts, domains)]

  def redact(self, text: str, domains: Sequence[str] | None = None) -> str:
    """`text` with every word in a private span replaced by `REDACTED`."""
    return self.redact_batch([text], domains)[0]

  def redact_batch(self, texts: Sequence[str],
                   domains: Sequence[str] | None = None) -> list[str]:
    """Per text: `redact(text, domains)`, with one `spans_batch` call."""
    return [redact_spans(t, s)
            for t, s in zip(texts, self.spans_batch(texts, domains))]

  def _check_domains(self, domains: Sequence[str] | None) -> tuple[str, ...]:
    if domains is None:
      return self.domains
    if isinstance(domains, str):
      raise TypeError("domains must be a sequence of names, not a str")
    unknown = [d for d in domains if d not in self.domains]
    if unknown:
      raise ValueError(f"unknown domains {unknown}; this policy knows "
                       f"{list(self.domains)}")
    return tuple(domains)


class KeywordPolicy(Policy):
  """Per-domain phrase lists, matched as whole words, case-insensitively.

  At each position the phrases are tried longest (most words) first, so the
  span of a match is that of the longest phrase starting there; all matches,
  including overlapping ones ("booking confirmation" and "confirmation
  number" in "booking confirmation number"), are private. The result does not
  depend on the order of the lists.

  Formal guarantees:
    * Every occurrence of a phrase of one of `domains` in `text` (its words
      separated by whitespace, bounded by non-word characters or the text's
      ends, any letter case) lies inside `spans(text, domains)`, and every
      span is a union of such occurrences.
    * Redaction is complete: `flags(redact(text, D), D)` is False. (A phrase
      in the redacted text that is not inside a `REDACTED` token was already
      a phrase occurrence of `text`, hence redacted; phrases containing the
      word "redacted" are refused so none can match the token itself.)
  """

  def __init__(self, phrases_by_domain: Mapping[str, Iterable[str]], *,
               domains: Sequence[str] | None = None):
    """Args:
      phrases_by_domain: {domain: phrases}; a phrase is one or more words.
      domains: the domains the policy covers (default: all of the mapping).

    Raises:
      ValueError: an empty or unknown domain list, an empty phrase, or a
        phrase containing the word "redacted".
    """
    if isinstance(phrases_by_domain, str) or not isinstance(phrases_by_domain, Mapping):
      raise TypeError("phrases_by_domain must be a mapping {domain: phrases}")
    domains = tuple(phrases_by_domain) if domains is None else tuple(domains)
    unknown = [d for d in domains if d not in phrases_by_domain]
    if unknown or not domains:
      raise ValueError(f"domains {list(domains)} must be a non-empty subset of "
                       f"{list(phrases_by_domain)}")
    self.domains = domains
    self.phrases = {d: self._check_phrases(d, phrases_by_domain[d])
                    for d in domains}
    self._patterns = {d: self._compile(p) for d, p in self.phrases.items()}

  @staticmethod
  def _check_phrases(domain: str, phrases: Iterable[str]) -> tuple[str, ...]:
    if isinstance(phrases, str):
      raise TypeError(f"phrases of {domain!r} must be a list of strings, not a str")
    out = []
    for p in phrases:
      if not isinstance(p, str) or not p.split():
        raise ValueError(f"{domain!r}: phrases must be non-empty strings, got {p!r}")
      if any(re.search(r"(?<!\w)redacted(?!\w)", w, re.IGNORECASE)
             for w in p.split()):
        raise ValueError(f"{domain!r}: phrase {p!r} would match {REDACTED}")
      out.append(" ".join(p.split()))
    return tuple(out)

  @staticmethod
  def _compile(phrases: Sequence[str]) -> re.Pattern | None:
    if not phrases:
      return None
    longest_first = sorted(set(phrases), key=lambda p: (-len(p.split()), -len(p), p))
    alternation = "|".join(r"\s+".join(map(re.escape, p.split()))
                           for p in longest_first)
    # A lookahead finds a match at every start position (overlaps included);
    # the alternation takes the first, i.e. longest, phrase that fits there.
    return re.compile(rf"(?<!\w)(?=({alternation})(?!\w))", re.IGNORECASE)

  @classmethod
  def from_json(cls, path: str, *, domains: Sequence[str] | None = None
                ) -> "KeywordPolicy":
    """Reads `{"DOMAIN": ["phrase", ...], ...}` (the layout of the paper's
    released keyword lists) from a UTF-8 JSON file."""
    if not os.path.isfile(path):
      raise FileNotFoundError(f"keyword file not found: {path!r}")
    with open(path, encoding="utf-8") as f:
      try:
        data = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
      raise ValueError(f"{path}: expected a JSON object of phrase lists "
                       '{"DOMAIN": ["phrase", ...]}')
    try:
      return cls(data, domains=domains)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from e

  def spans_batch(self, texts: Sequence[str],
                  domains: Sequence[str] | None = None) -> list[list[Span]]:
    patterns = [self._patterns[d] for d in self._check_domains(domains)]
    patterns = [p for p in patterns if p is not None]
    return [merge_spans((m.start(1), m.end(1))
                        for p in patterns for m in p.finditer(text))
            for text in texts]


class ClassifierPolicy(Policy):
  """Windows of words scored by a domain classifier; flagged windows are
  private.

  Each text is cut into windows of `window_words` words (`word_windows`:
  stride `stride`, the last window ending at the last word). All windows of a
  batch of texts go to `scorer` in one call. A window is flagged for
  `domains` when the probability of one of them exceeds `threshold` (the
  paper's z); the words of flagged windows, merged where windows overlap, are
  the spans.

  Formal guarantees:
    * Every word of a window w with max_{d in domains} scorer(w)[d] >
      threshold lies in a span, and every spanned word lies in such a window.
    * Unlike `KeywordPolicy`, re-scoring a redacted text may flag new windows
      (the classifier sees `REDACTED` tokens as context).
  """

  def __init__(self, scorer: Callable[[Sequence[str]], np.ndarray],
               domains: Sequence[str], *, threshold: float = 0.9,
               window_words: int = 16, stride: int = 8):
    """Args:
      scorer: window texts (words joined by single spaces) -> `[n, len(domains)]`
        class probabilities, e.g. `dpjax.pipelines.dialog.classifier.DomainClassifier
        .probabilities`.
      domains: the scorer's classes, in its column order.
      threshold: z; a window is flagged when a probability exceeds it.
      window_words, stride: the windows (see `word_windows`).
    """
    word_windows(0, window_words, stride)  # validates them
    if isinstance(domains, str) or not domains:
      raise ValueError("domains must be a non-empty sequence of names")
    self.scorer = scorer
    self.domains = tuple(domains)
    self.threshold = float(threshold)
    self.window_words = int(window_words)
    self.stride = int(stride)

  def spans_batch(self, texts: Sequence[str],
                  domains: Sequence[str] | None = None) -> list[list[Span]]:
    columns = [self.domains.index(d) for d in self._check_domains(domains)]
    words = [[(m.start(), m.end()) for m in _WORD.finditer(t)] for t in texts]
    starts = [word_windows(len(w), self.window_words, self.stride) for w in words]
    windows = [" ".join(text[a:b] for a, b in w[s:s + self.window_words])
               for text, w, ss in zip(texts, words, starts) for s in ss]
    if not windows or not columns:
      return [[] for _ in texts]
    probs = np.asarray(self.scorer(windows))
    if probs.shape != (len(windows), len(self.domains)):
      raise ValueError(f"scorer returned shape {probs.shape}, expected "
                       f"{(len(windows), len(self.domains))}")
    flagged = iter(probs[:, columns].max(axis=1) > self.threshold)
    out = []
    for w, ss in zip(words, starts):
      private = np.zeros(len(w) + 1, bool)  # a False sentinel ends every run
      for s in ss:
        if next(flagged):
          private[s:min(s + self.window_words, len(w))] = True
      edges = np.flatnonzero(np.diff(np.concatenate([[False], private])))
      out.append([(w[a][0], w[b - 1][1]) for a, b in zip(edges[::2], edges[1::2])])
    return out


__all__ = ["REDACTED", "Span", "Policy", "KeywordPolicy", "ClassifierPolicy",
           "merge_spans", "redact_spans", "word_windows"]
