"""Runs the examples in the privacy modules' docstrings."""

import doctest

import pytest

from dpjax.privacy import accounting, clipping, ledger, noise, optimizers
from dpjax.privacy import sampling


@pytest.mark.parametrize(
    "module", [accounting, clipping, ledger, noise, optimizers, sampling])
def test_docstring_examples(module):
  result = doctest.testmod(module)
  assert result.failed == 0
