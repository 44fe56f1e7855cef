"""Splitting SeqPATE's private data among M teachers.

An assignment is an int array `[n]`: the teacher (0..M-1) of each private
example. Two ways to make one:

* `sample_partition` (sample-level DP): a seeded random permutation dealt
  round-robin, so teacher sizes differ by at most one.
* `user_partition` (phrase-level DP, paper Sec. 5.3 and App. F): all of a
  user's examples on as few teachers as possible, sizes balanced. Users,
  largest first, go whole to the teacher with the least room that still fits
  them (best-fit decreasing); a user that fits nowhere fills the teacher with
  the most room and the rest of it is placed the same way. Capacities are
  `n // M` or `n // M + 1`, so sizes differ by at most one. Each split fills
  a teacher and some room is always left elsewhere, so there are at most
  M - 1 splits: at most `users + M - 1` (user, teacher) pairs in total.

`phrase_teacher_counts` gives, per secret phrase, the number of teachers whose
data contain it: the n_s of the phrase-level accounting.

Formal guarantees
-----------------
* `sample_partition` depends on (n, M, seed) only, never on the examples'
  content, so replacing one example's content (replace-one adjacency)
  changes exactly one teacher's training set: the premise of the sqrt(2)
  sensitivity in `dpjax.pipelines.seqpate.accounting`.
* `user_partition` depends on the user ids (how many examples each user has)
  and the seed only. Neighbouring datasets that differ in the occurrences of
  one phrase (same users, same number of examples each) get the same
  assignment, so only the `phrase_teacher_counts` teachers holding the phrase
  see different data.
"""
from __future__ import annotations

import bisect
import heapq
import re
from typing import Hashable, Sequence

import numpy as np


def _check_sizes(num_examples: int, num_teachers: int) -> None:
  if num_teachers < 1:
    raise ValueError(f"num_teachers must be >= 1, got {num_teachers}.")
  if num_examples < num_teachers:
    raise ValueError(f"{num_examples} examples cannot give each of "
                     f"{num_teachers} teachers at least one.")


def sample_partition(num_examples: int, num_teachers: int,
                     seed: int) -> np.ndarray:
  """Teacher of each example: a seeded permutation dealt round-robin."""
  _check_sizes(num_examples, num_teachers)
  order = np.random.default_rng(seed).permutation(num_examples)
  assignment = np.empty(num_examples, np.int32)
  assignment[order] = np.arange(num_examples) % num_teachers
  return assignment


def _best_fit_plan(counts: np.ndarray, capacities: np.ndarray,
                   order: np.ndarray) -> list[tuple[int, int, int]]:
  """(user, teacher, count) pieces: best-fit decreasing, splitting a user
  only when no teacher has room for all of it (see the module docstring)."""
  rooms = sorted((int(c), t) for t, c in enumerate(capacities))
  # Max-heap of pieces by size; ties by `order` (the seeded user order).
  rank = np.empty(len(order), np.int64)
  rank[order] = np.arange(len(order))
  pieces = [(-int(counts[u]), int(rank[u]), int(u)) for u in order]
  heapq.heapify(pieces)
  plan = []
  while pieces:
    neg_size, r, user = heapq.heappop(pieces)
    size = -neg_size
    i = bisect.bisect_left(rooms, (size, -1))
    if i < len(rooms):  # the fullest teacher that still fits it whole
      room, teacher = rooms.pop(i)
      placed = size
    else:  # fits nowhere: fill the emptiest teacher, place the rest later
      room, teacher = rooms.pop()
      placed = room
      heapq.heappush(pieces, (-(size - room), r, user))
    plan.append((user, teacher, placed))
    if room > placed:
      bisect.insort(rooms, (room - placed, teacher))
  return plan


def user_partition(user_ids: Sequence[Hashable] | np.ndarray,
                   num_teachers: int, seed: int) -> np.ndarray:
  """Teacher of each example, keeping users together (module docstring).

  Ties between users of equal size, and which of a split user's examples go
  to which teacher, follow a permutation seeded by `seed`.
  """
  n = len(user_ids)
  _check_sizes(n, num_teachers)
  if any(u is None for u in user_ids):
    raise ValueError("user_partition needs a user id for every example "
                     "(a corpus without users takes sample_partition).")
  _, user_of, counts = np.unique(np.asarray(user_ids), return_inverse=True,
                                 return_counts=True)
  rng = np.random.default_rng(seed)
  capacities = n // num_teachers + (np.arange(num_teachers) < n % num_teachers)
  plan = _best_fit_plan(counts, capacities, rng.permutation(len(counts)))
  # Each user's examples in a seeded order, consumed piece by piece.
  examples = rng.permutation(n)
  examples = examples[np.argsort(user_of[examples], kind="stable")]
  next_example = np.concatenate([[0], np.cumsum(counts)[:-1]])
  assignment = np.full(n, -1, np.int32)
  for user, teacher, count in plan:
    start = next_example[user]
    assignment[examples[start:start + count]] = teacher
    next_example[user] += count
  assert (assignment >= 0).all()
  return assignment


def teacher_sizes(assignment: np.ndarray, num_teachers: int) -> np.ndarray:
  """The examples of each teacher: `[num_teachers]` counts of `assignment`."""
  return np.bincount(assignment, minlength=num_teachers)


def teachers_per_user(assignment: np.ndarray,
                      user_ids: Sequence[Hashable] | np.ndarray
                      ) -> dict[Hashable, int]:
  """How many distinct teachers hold each user's examples."""
  users, user_of = np.unique(np.asarray(user_ids), return_inverse=True)
  pairs = np.unique(np.stack([user_of, assignment]), axis=1)
  per_user = np.bincount(pairs[0], minlength=len(users))
  return {u.item() if hasattr(u, "item") else u: int(c)
          for u, c in zip(users, per_user)}


def _words(text: str) -> tuple[str, ...]:
  return tuple(re.findall(r"\w+|[^\w\s]", text))


def phrase_teacher_counts(phrases: Sequence[str], texts: Sequence[str],
                          assignment: np.ndarray) -> np.ndarray:
  """`[len(phrases)]`: how many distinct teachers hold a text containing each
  phrase (0 for a phrase in no text).

  A phrase occurs where its word sequence (words and punctuation marks,
  case-sensitive) appears in the text's; every occurrence counts, also one
  inside a longer phrase, so no teacher holding a phrase is missed.
  """
  if len(texts) != len(assignment):
    raise ValueError(f"{len(texts)} texts but {len(assignment)} assignments.")
  index = {_words(p): i for i, p in enumerate(phrases)}
  if () in index:
    raise ValueError("phrases must contain at least one word.")
  if len(index) != len(phrases):
    raise ValueError("phrases must be distinct (as word sequences).")
  lengths = sorted({len(w) for w in index})
  held = set()
  for text, teacher in zip(texts, assignment):
    words = _words(text)
    for n in lengths:
      for start in range(len(words) - n + 1):
        phrase = index.get(words[start:start + n])
        if phrase is not None:
          held.add((phrase, int(teacher)))
  counts = np.zeros(len(phrases), np.int64)
  for phrase, _ in held:
    counts[phrase] += 1
  return counts
