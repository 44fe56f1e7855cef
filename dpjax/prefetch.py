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
masks, not activations). The worker thread idles after the last step and
ends with the `Ahead`. A step asked out of order (a resume, a loop that
skips) is made in the foreground and prefetching goes on from there. An
error in `make(i + 1)` is raised by the call for step i + 1, not earlier.
Nothing here is a release: the prefetched sample is secret like every other.
"""
from __future__ import annotations

import concurrent.futures
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
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="dpjax-prefetch")
    self._next: tuple[int, concurrent.futures.Future] | None = None

  def __call__(self, i: int) -> T:
    pending, self._next = self._next, None
    if pending is not None and pending[0] == i:
      value = pending[1].result()
    else:
      if pending is not None:  # out of order: drop what was made for nothing
        pending[1].cancel()
      value = self._make(i)
    if i + 1 < self._stop:
      self._next = (i + 1, self._pool.submit(self._make, i + 1))
    return value
