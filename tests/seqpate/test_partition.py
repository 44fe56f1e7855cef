"""Teacher partitions against hand examples and brute-force checks."""
import collections

import numpy as np
import pytest

from dpjax.pipelines.seqpate import partition


def _pairs(assignment, users):
  return collections.Counter(u for u, _ in set(zip(users, assignment)))


@pytest.mark.parametrize("n,m", [(10, 3), (1000, 7), (64, 64)])
def test_sample_partition_is_disjoint_cover_and_balanced(n, m):
  a = partition.sample_partition(n, m, seed=3)
  assert a.shape == (n,) and set(a.tolist()) == set(range(m))
  sizes = np.bincount(a, minlength=m)
  assert sizes.sum() == n and sizes.max() - sizes.min() <= 1
  # A function of (n, M, seed): the same again, different with another seed.
  np.testing.assert_array_equal(a, partition.sample_partition(n, m, seed=3))
  if n > m:
    assert not np.array_equal(a, partition.sample_partition(n, m, seed=4))


def test_user_partition_hand_example():
  # Users a:5 b:3 c:2 d:2 over 3 teachers of capacity 4. The best packing
  # splits only a (it cannot fit in 4): {a4}, {a1, b3}, {c2, d2}.
  users = ["a"] * 5 + ["b"] * 3 + ["c"] * 2 + ["d"] * 2
  a = partition.user_partition(users, 3, seed=0)
  assert sorted(np.bincount(a).tolist()) == [4, 4, 4]
  assert partition.teachers_per_user(a, users) == {"a": 2, "b": 1, "c": 1,
                                                   "d": 1}
  teacher_of = {u: {int(t) for uu, t in zip(users, a) if uu == u} for u in "bcd"}
  assert teacher_of["c"] == teacher_of["d"] != teacher_of["b"]


def test_user_partition_large_user_needs_ceil_size_over_capacity():
  users = ["big"] * 10 + ["x", "y"]
  a = partition.user_partition(users, 3, seed=1)
  assert np.bincount(a).tolist() == [4, 4, 4]
  assert partition.teachers_per_user(a, users)["big"] == 3  # ceil(10 / 4)


@pytest.mark.parametrize("seed", range(5))
def test_user_partition_random_instances(seed):
  rng = np.random.default_rng(seed)
  counts = rng.zipf(1.8, size=60).clip(max=80)
  users = np.repeat(np.arange(60), counts)
  m = 9
  a = partition.user_partition(users, m, seed=seed)
  sizes = np.bincount(a, minlength=m)
  assert sizes.sum() == len(users) and sizes.max() - sizes.min() <= 1
  per_user = partition.teachers_per_user(a, users)
  cap = -(-len(users) // m)
  for u, c in zip(range(60), counts):
    assert per_user[u] >= -(-c // cap)  # the minimum any balanced split needs
  # At most M - 1 splits in all.
  assert sum(per_user.values()) <= 60 + m - 1


def test_partitions_reject_too_few_examples():
  with pytest.raises(ValueError, match="at least one"):
    partition.sample_partition(3, 4, 0)
  with pytest.raises(ValueError, match="at least one"):
    partition.user_partition(["a", "b"], 3, 0)
  with pytest.raises(ValueError, match="user id"):
    partition.user_partition(["a", None, "b"], 2, 0)


def test_phrase_teacher_counts_hand_example():
  texts = ["I am Janet Miller.", "Janet Miller called.", "Hello Janet.",
           "Thanks, Janet Millerson.", "Janet Miller again"]
  assignment = np.array([0, 1, 1, 2, 0])
  counts = partition.phrase_teacher_counts(
      ["Janet Miller", "Janet", "Bob Stone"], texts, assignment)
  # "Janet Miller": texts 0, 1, 4 -> teachers {0, 1}; "Janet" also inside
  # "Janet Miller" and "Janet Millerson" -> {0, 1, 2}; "Bob Stone": none.
  np.testing.assert_array_equal(counts, [2, 3, 0])
  with pytest.raises(ValueError, match="distinct"):
    partition.phrase_teacher_counts(["a b", "a  b"], texts, assignment)
