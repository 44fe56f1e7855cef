"""SeqPATE's NoisySGD baseline (Tian et al., NeurIPS 2022, Sec. 6.1): Pub-GPT
fine-tuned on the private training set with DP-SGD by dpjax's trainer.

`train_noisysgd` exports Pub-GPT as a Hugging Face checkpoint (the
trainer's INITIAL_CHECKPOINT_PATH), registers the seqio task of the private
split (`tasks.seqpate.register_private_lm_task`: the teachers' sentences, as
the same token rows), and trains it with `harness.train_run` and
`gin/seqpate_noisysgd.gin` (DP-Adam, Poisson sampling, σ calibrated by
dp-accounting for the planned steps at the table's ε and δ = 1e-5). The
model, lengths, ε, δ and seed are the table's settings, set as RunConfig
fields over any caller bindings, so they always match the other rows. A
finished run (its `train_summary.json`) is not retrained; an interrupted
one resumes.
The paper's "NoisySGD+D^pub" continues from the returned params on the
pseudo-data without privacy (`dpjax.pipelines.seqpate.experiment`).

Formal guarantees
-----------------
Those of the trainer's Poisson-sampled DP-SGD (`dpjax.training.trainer`,
`dpjax.privacy`): (ε, δ) under add-or-remove-one adjacency of private
sentences, as recorded in the run's `privacy_ledger.json`, which is what
`train_noisysgd` returns. SeqPATE's teacher queries are accounted under
replace-one adjacency (`dpjax.pipelines.seqpate.accounting`); as in the paper, the
rows are compared at the same nominal ε. Fine-tuning on public pseudo-data
afterwards is post-processing.

The trainer imports the data layer (TensorFlow) when it runs; this module
imports none of it.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import jax

from dpjax.pipelines import harness
from dpjax.generation import inference
from dpjax.models import gpt2
from dpjax.pretrained import hf
from dpjax.privacy import ledger as ledger_lib
from tasks import seqpate as data

GIN_FILES = ("seqpate_noisysgd.gin",)


def train_noisysgd(model_dir: str, *, config: gpt2.GPT2Config, init_params,
                   dataset: str, split_seed: int, public_fraction: float,
                   test_fraction: float, max_examples: int | None,
                   length: int, epsilon: float, delta: float, seed: int,
                   gin_files: Sequence[str] = GIN_FILES,
                   bindings: Sequence[str] = ()
                   ) -> tuple[Any, ledger_lib.PrivacyLedger]:
  """DP-SGD fine-tuning of `init_params` (Pub-GPT) on the private split of
  (`dataset`, `split_seed`, fractions, `max_examples`) with rows of `length`
  tokens, in `model_dir`; returns (params, the run's ledger)."""
  model_dir = os.path.abspath(model_dir)
  if not harness.finished_summary(model_dir):
    init_dir = os.path.join(model_dir, "init_hf")
    if not os.path.isfile(os.path.join(init_dir, hf.CONFIG_FILE)):
      hf.export_hf(jax.device_get(init_params), config, init_dir)
    task = data.register_private_lm_task(
        dataset, split_seed, public_fraction=public_fraction,
        test_fraction=test_fraction, max_examples=max_examples)
    harness.train_run(
        model_dir, gin_files, bindings, model_config=config,
        initial_checkpoint_path=init_dir, mixture_or_task_name=task.name,
        task_feature_lengths={"targets": length - 1},
        target_epsilon=float(epsilon), delta=float(delta), seed=seed)
  params, meta = inference.load_trained(model_dir)[1:]
  # On the host, as the table's other params (read from msgpack): arrays
  # committed to a device would make every jitted evaluation compile again.
  return jax.device_get(params), meta.privacy_ledger()
