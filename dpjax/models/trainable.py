"""What the trainer needs of a model, whatever its architecture.

`trainable(config, task_feature_lengths)` looks at the config's type and
returns the model's parameter constructors and losses with the sequence
lengths bound, plus the name of the feature converter its batches come from
(`dpjax.data.arrays.load_task_arrays(converter=...)`):

* `T5Config`  -> "encoder_decoder": inputs -> encoder, targets -> decoder.
* `GPT2Config` -> "decoder_only": `[bos] + inputs + targets` in one causal
  sequence of length `inputs + targets`, the prompt masked out of the loss.
* `DualEncoderConfig` -> a `dual_encoder.PairGroups`: lengths `queries` and
  `documents`; a row is a group of pairs and its loss the in-batch softmax
  within the group (see `dpjax.models.dual_encoder` for why).

Nothing here imports TensorFlow.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax

from dpjax.models import dual_encoder, gpt2, t5

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Trainable:
  config: Any
  # "encoder_decoder" | "decoder_only" | the dual encoder's pair grouping
  converter: str | dual_encoder.PairGroups
  init_params: Callable[[jax.Array], tuple[PyTree, PyTree]]  # rng -> (params, axes)
  abstract_params: Callable[[], tuple[PyTree, PyTree]]  # -> (shapes, axes)
  example_loss: Callable[[PyTree, Mapping[str, jax.Array]], jax.Array]
  batch_loss: Callable[[PyTree, Mapping[str, jax.Array]], jax.Array]


CONFIG_CLASSES = {cls.__name__: cls for cls in (
    t5.T5Config, gpt2.GPT2Config, dual_encoder.DualEncoderConfig)}


def config_from_json(class_name: str | None, fields: Mapping[str, Any]):
  """The model config saved with a checkpoint (`type(config).__name__` and
  `config.to_json()`); checkpoints from before the class was saved are T5."""
  if (class_name or "T5Config") not in CONFIG_CLASSES:
    raise ValueError(f"unknown model config class {class_name!r}; expected "
                     f"one of {sorted(CONFIG_CLASSES)}")
  return CONFIG_CLASSES[class_name or "T5Config"].from_json(fields)


def trainable(config, task_feature_lengths: Mapping[str, int]) -> Trainable:
  lengths = dict(task_feature_lengths)
  if isinstance(config, t5.T5Config):
    kw = dict(input_length=lengths["inputs"], target_length=lengths["targets"])
    return Trainable(
        config, "encoder_decoder",
        lambda rng: t5.init_params(config, rng, **kw),
        functools.partial(t5.abstract_params, config, **kw),
        t5.make_example_loss(config), t5.make_batch_loss(config))
  if isinstance(config, gpt2.GPT2Config):
    kw = dict(max_length=lengths.get("inputs", 1) + lengths["targets"])
    return Trainable(
        config, "decoder_only",
        lambda rng: gpt2.init_params(config, rng, **kw),
        functools.partial(gpt2.abstract_params, config, **kw),
        gpt2.make_example_loss(config), gpt2.make_batch_loss(config))
  if isinstance(config, dual_encoder.DualEncoderConfig):
    for name in ("queries", "documents"):
      if name not in lengths:
        raise KeyError(f"the dual encoder needs a {name!r} feature length, "
                       f"got {sorted(lengths)}")
    return Trainable(
        config, dual_encoder.PairGroups(config.group_size, config.group_seed),
        lambda rng: dual_encoder.init_params(config, rng),
        functools.partial(dual_encoder.abstract_params, config),
        dual_encoder.make_example_loss(config),
        dual_encoder.make_batch_loss(config))
  raise TypeError(f"no trainer support for {type(config).__name__}; "
                  "expected a T5Config, GPT2Config or DualEncoderConfig")
