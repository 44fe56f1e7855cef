"""prefetch.Ahead: step i + 1 is made on a background thread while step i is
used, and every step's value is exactly `make`'s."""
import threading

import numpy as np
import pytest

from dpjax.training import prefetch


def test_values_equal_make_in_order_and_out_of_order():
  make = lambda i: np.random.default_rng(i).normal(size=4)
  ahead = prefetch.Ahead(make, stop=10)
  for i in [0, 1, 2, 5, 6, 3, 9]:  # a resume and a skip back included
    np.testing.assert_array_equal(ahead(i), make(i))


def test_the_next_step_is_made_on_another_thread_while_this_one_is_used():
  started, release = threading.Event(), threading.Event()
  threads = {}

  def make(i):
    threads[i] = threading.current_thread().name
    if i == 1:
      started.set()
      assert release.wait(10)
    return i

  ahead = prefetch.Ahead(make, stop=3)
  assert ahead(0) == 0
  # Step 1 is under way before anyone asks for it, and not on this thread.
  assert started.wait(10)
  assert threads[1].startswith("dpjax-prefetch")
  release.set()
  assert ahead(1) == 1
  assert threads[0] == threading.current_thread().name


def test_nothing_is_made_past_stop():
  made = []
  ahead = prefetch.Ahead(lambda i: made.append(i) or i, stop=2)
  assert [ahead(0), ahead(1)] == [0, 1]
  assert sorted(made) == [0, 1]


def test_an_error_in_the_next_step_is_raised_when_that_step_is_asked():
  def make(i):
    if i == 1:
      raise ValueError("malformed row 17")
    return i

  ahead = prefetch.Ahead(make, stop=3)
  assert ahead(0) == 0
  with pytest.raises(ValueError, match="malformed row 17"):
    ahead(1)
