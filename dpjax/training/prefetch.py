"""One step ahead on the host: the next step's batch is sampled, gathered and
placed on the devices while the devices run the current step.

A DP step's host work is the sample (a Poisson draw or an epoch's
permutation), the gather of its rows from the host arrays, and their
transfer. `Ahead(make, stop)` returns `make(i)` for step i and, before
returning, starts `make(i + 1)` on a background thread, so that work overlaps
the device's step i instead of following it. The values are exactly those
`make` gives (it must be a pure function of i: the samplers' batches are
functions of (secret, step)), so a prefetched run is bit-identical to an
unprefetched one.

Costs and limits: one extra step's batch lives on the devices (tokens and
masks, not activations). Each step's work runs on its own daemon thread,
so a process that stops early never waits for it. A step asked out of order
(a resume, a loop that skips) is made in the foreground and prefetching goes
on from there. An
error in `make(i + 1)` is raised by the call for step i + 1, not earlier.
Nothing here is a release: the prefetched sample is secret like every other.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Ahead(Generic[T]):
  """`ahead(i)` is `make(i)`, with `make(i + 1)` started in the background
  (when `i + 1 < stop`).

  >>> made = []
  >>> ahead = Ahead(lambda i: made.append(i) or i * i, stop=3)
  >>> [ahead(0), ahead(1), ahead(2)], sorted(made)
  ([0, 1, 4], [0, 1, 2])
  """

  def __init__(self, make: Callable[[int], T], *, stop: int):
    self._make, self._stop = make, stop
    self._next: tuple[int, _Job] | None = None

  def __call__(self, i: int) -> T:
    pending, self._next = self._next, None
    # Out of order (a resume, a skip): what was made ahead is dropped.
    value = (pending[1].result() if pending is not None and pending[0] == i
             else self._make(i))
    if i + 1 < self._stop:
      self._next = (i + 1, _Job(self._make, i + 1))
    return value


class _Job:
  """`make(i)` on a daemon thread: a process that ends (an error, a
  preemption) never waits for a step it will not run."""

  def __init__(self, make: Callable[[int], T], i: int):
    self._done = threading.Event()
    self._value = self._error = None
    threading.Thread(target=self._run, args=(make, i), daemon=True,
                     name=f"dpjax-prefetch-{i}").start()

  def _run(self, make, i):
    try:
      self._value = make(i)
    except BaseException as e:  # raised where the step is asked for
      self._error = e
    finally:
      self._done.set()

  def result(self):
    self._done.wait()
    if self._error is not None:
      raise self._error
    return self._value
