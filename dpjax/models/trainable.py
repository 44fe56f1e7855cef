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
* `GPT2DiscConfig` -> "decoder_only" like GPT-2, with two named per-example
  losses (`example_losses`: "lm" and "disc", or "disc" alone with
  `head_only`), each clipped and noised as its own release, the frozen
  layers' mask (`trainable_mask`), and a per-example key always attached
  (the discriminator's random label-slot token); eval is the LM loss.

Nothing here imports TensorFlow.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import numpy as np

from dpjax.models import dual_encoder, gpt2, gpt2_disc, lora, t5

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Trainable:
  """What the trainer needs of a model: its config, params and losses."""
  config: Any
  # "encoder_decoder" | "decoder_only" | the dual encoder's pair grouping
  converter: str | dual_encoder.PairGroups
  init_params: Callable[[jax.Array], tuple[PyTree, PyTree]]  # rng -> (params, axes)
  abstract_params: Callable[[], tuple[PyTree, PyTree]]  # -> (shapes, axes)
  example_loss: Callable[[PyTree, Mapping[str, jax.Array]], jax.Array]
  batch_loss: Callable[[PyTree, Mapping[str, jax.Array]], jax.Array]
  # Each example carries a `dropout_rng` key (dropout, or a loss's randomness).
  example_rng: bool = False
  # Several named losses of one example, each its own clipped, noised release
  # (`loss_names` of them); None: `example_loss` is the one release.
  example_losses: Callable[[PyTree, Mapping[str, jax.Array]],
                           dict[str, jax.Array]] | None = None
  loss_names: tuple[str, ...] = ()
  # params (or shapes) -> bools: the leaves that train; None: all of them.
  trainable_mask: Callable[[PyTree], PyTree] | None = None
  # Raises ValueError on training arrays the losses cannot use.
  check_arrays: Callable[[Mapping[str, np.ndarray]], None] = lambda arrays: None


CONFIG_CLASSES = {cls.__name__: cls for cls in (
    t5.T5Config, gpt2.GPT2Config, dual_encoder.DualEncoderConfig,
    gpt2_disc.GPT2DiscConfig)}


def config_from_json(class_name: str | None, fields: Mapping[str, Any]):
  """The model config saved with a checkpoint (`type(config).__name__` and
  `config.to_json()`); checkpoints from before the class was saved are T5."""
  if (class_name or "T5Config") not in CONFIG_CLASSES:
    raise ValueError(f"unknown model config class {class_name!r}; expected "
                     f"one of {sorted(CONFIG_CLASSES)}")
  return CONFIG_CLASSES[class_name or "T5Config"].from_json(fields)


def trainable(config, task_feature_lengths: Mapping[str, int]) -> Trainable:
  """The `Trainable` of model `config` at the task's feature lengths.

  The same object for equal arguments (memoized: a pure function of them),
  so the steps placed for it are found again (`step.place_steps`).

  Raises:
    TypeError: `config` is not a T5, GPT-2, GPT-2 discriminator or dual
      encoder config.
  """
  key = (config, tuple(sorted(dict(task_feature_lengths).items())))
  try:
    hash(key)
  except TypeError:  # a config holding a list: built afresh
    return _trainable(*key)
  return _memo_trainable(key)


@functools.lru_cache(maxsize=32)
def _memo_trainable(key) -> Trainable:
  return _trainable(*key)


def _trainable(config, lengths: tuple[tuple[str, int], ...]) -> Trainable:
  lengths = dict(lengths)
  if isinstance(config, t5.T5Config):
    kw = dict(input_length=lengths["inputs"], target_length=lengths["targets"])
    return Trainable(
        config, "encoder_decoder",
        lambda rng: t5.init_params(config, rng, **kw),
        _once(functools.partial(t5.abstract_params, config, **kw)),
        t5.make_example_loss(config), t5.make_batch_loss(config),
        example_rng=config.dropout_rate > 0 or _lora_dropout(config),
        trainable_mask=_lora_mask(config))
  if isinstance(config, gpt2.GPT2Config):
    kw = dict(max_length=lengths.get("inputs", 1) + lengths["targets"])
    return Trainable(
        config, "decoder_only",
        lambda rng: gpt2.init_params(config, rng, **kw),
        _once(functools.partial(gpt2.abstract_params, config, **kw)),
        gpt2.make_example_loss(config), gpt2.make_batch_loss(config),
        example_rng=config.dropout_rate > 0 or _lora_dropout(config),
        trainable_mask=_lora_mask(config))
  if isinstance(config, gpt2_disc.GPT2DiscConfig):
    return _gpt2_disc(config, lengths)
  if isinstance(config, dual_encoder.DualEncoderConfig):
    for name in ("queries", "documents"):
      if name not in lengths:
        raise KeyError(f"the dual encoder needs a {name!r} feature length, "
                       f"got {sorted(lengths)}")
    return Trainable(
        config, dual_encoder.PairGroups(config.group_size, config.group_seed),
        lambda rng: dual_encoder.init_params(config, rng),
        _once(functools.partial(dual_encoder.abstract_params, config)),
        dual_encoder.make_example_loss(config),
        dual_encoder.make_batch_loss(config),
        example_rng=config.dropout_rate > 0 or _lora_dropout(config.encoder),
        trainable_mask=_lora_mask(config.encoder))
  raise TypeError(f"no trainer support for {type(config).__name__}; "
                  "expected a T5Config, GPT2Config, DualEncoderConfig or "
                  "GPT2DiscConfig")


def _once(abstract_params: Callable[[], tuple[PyTree, PyTree]]):
  """`abstract_params` traced once: the plan, the mask of trained leaves,
  the placed steps and the sizing all ask for the shapes, and each trace of
  a model's init takes seconds. Callers read the trees, never change them."""
  return functools.cache(abstract_params)


def _lora_mask(config):
  """LoRA: only the adapters (and what `LoRAConfig.train` adds) train."""
  return (None if config.lora is None
          else functools.partial(lora.trainable_mask, config.lora))


def _lora_dropout(config) -> bool:
  return config.lora is not None and config.lora.dropout > 0


def _gpt2_disc(config: gpt2_disc.GPT2DiscConfig, lengths) -> Trainable:
  kw = dict(max_length=lengths.get("inputs", 1) + lengths["targets"])
  names = ("disc",) if config.head_only else ("lm", "disc")
  both = gpt2_disc.make_example_losses(config)
  losses = lambda params, example: {k: v for k, v in both(params, example).items()
                                    if k in names}
  lm_batch_loss = gpt2.make_batch_loss(config.lm)

  def check_arrays(arrays):
    gpt2_disc.check_label_slots(config, arrays["tokens"])

  return Trainable(
      config, "decoder_only",
      lambda rng: gpt2_disc.init_params(config, rng, **kw),
      _once(functools.partial(gpt2_disc.abstract_params, config, **kw)),
      # The joint objective (a public step's loss); DP steps clip each loss.
      lambda params, example: sum(losses(params, example).values()),
      lambda params, batch: lm_batch_loss(gpt2_disc.lm_params(params), batch),
      example_rng=True, example_losses=losses, loss_names=names,
      trainable_mask=functools.partial(gpt2_disc.trainable_mask, config),
      check_arrays=check_arrays)
