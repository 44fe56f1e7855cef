"""Runs the examples in the privacy modules' docstrings."""

import doctest

import pytest

from dpjax.privacy import accounting, clipping, clipping_method, ghost, ledger
from dpjax.privacy import noise, optimizers, sampling


@pytest.mark.parametrize(
    "module",
    [accounting, clipping, clipping_method, ghost, ledger, noise, optimizers,
     sampling])
def test_docstring_examples(module):
  result = doctest.testmod(module)
  assert result.failed == 0
