"""Models for dpjax: T5 (v1.0 / v1.1) and the losses the DP trainer uses."""
from dpjax.models.losses import per_example_loss, token_cross_entropy
from dpjax.models.t5 import (
    T5Config,
    T5Transformer,
    abstract_params,
    init_params,
    make_batch_loss,
    make_example_loss,
    param_count,
)

__all__ = [
    "T5Config",
    "T5Transformer",
    "abstract_params",
    "init_params",
    "make_batch_loss",
    "make_example_loss",
    "param_count",
    "per_example_loss",
    "token_cross_entropy",
]
