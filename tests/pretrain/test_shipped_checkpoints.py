"""The checkpoints shipped in tasks/data/pretrained/ (made by
`python -m dpjax.pretrain --gin_file=gin/pretrain/<name>.gin`): their files
are those SHA256SUMS records, they load through the same path as a user's
real checkpoint (`dpjax.pretrained.load_pretrained`, with the pretraining
gin's model config), and they predict their public corpus's held-out split
far better than the same model at random init."""
import os

import gin
import jax
import numpy as np
import pytest

from dpjax import configurables
from dpjax import gin_cli, pretrain, pretrained
from dpjax.models import trainable as trainable_lib
from tasks import pretraining

NAMES = ("msmarco_t5", "semparse_t5", "semparse_gpt2", "multidogo_gpt2",
         "textcls_gpt2", "seqpate_gpt2")
# Nats per target token the pretrained model must beat random init by on the
# public validation split (first 128 examples). Measured when shipped: random
# init 7.1-7.9 (about ln V), the checkpoints 0.75-2.65, margins 4.96-6.7.
MARGIN = 4.0
EXAMPLES = 128


def _path(name):
  return pretraining.PATHS_ABS[f"PRETRAINED_{name.upper()}"]


@pytest.mark.parametrize("name", NAMES)
def test_files_match_their_checksums(name):
  sums = pretrain.read_checksums(_path(name))
  assert "model.safetensors" in sums and "config.json" in sums
  for file, digest in sums.items():
    assert pretrain.sha256(os.path.join(_path(name), file)) == digest, file


def _mean_loss(model, params, arrays):
  loss = jax.jit(model.batch_loss)
  return float(np.mean(loss(params, arrays)))


@pytest.mark.parametrize("name", NAMES)
def test_loads_and_beats_random_init(name):
  from dpjax.data import arrays as data_arrays

  gin.clear_config()
  try:
    gin_cli.configure([f"gin/pretrain/{name}.gin"], [])
    config = configurables.run_config()
    pretraining.register_pretraining_task()
  finally:
    gin.clear_config()
  lengths = dict(config.task_feature_lengths)
  model = trainable_lib.trainable(config.model_config, lengths)
  arrays = data_arrays.load_task_arrays(
      config.mixture_or_task_name, "validation", lengths,
      converter=model.converter)
  arrays = {k: v[:EXAMPLES] for k, v in arrays.items()}
  shipped = pretrained.load_pretrained(_path(name), config.model_config)
  random, _ = model.init_params(jax.random.key(0))
  trained, untrained = (_mean_loss(model, p, arrays)
                        for p in (shipped, random))
  assert trained < untrained - MARGIN, (trained, untrained)
