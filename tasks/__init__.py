"""seqio tasks of dpjax (data layer: TensorFlow/seqio live here and in
`dpjax.data`, never in `dpjax.privacy`, `dpjax.models` or the train step).
The datasets' readers are `dpjax.data.readers`; this package only registers the
tasks built on them.

Importing this package registers nothing: it only makes the gin configurables
available (`register_tasks`, `register_msmarco_query_generation`,
`register_msmarco_dual_encoder`, `register_semparse_tasks`,
`register_multidogo_tasks`, `register_textcls_tasks`,
`register_pretraining_task`) and does not import
TensorFlow. The trainer calls
`register_tasks()` after parsing its gin files, e.g.::

    register_msmarco_query_generation.data_dir = "/data/msmarco"
    register_msmarco_query_generation.vocabulary_path = "/data/t5/spm.model"
    register_semparse_tasks.smcalflow_dir = "/data/smcalflow2.0"
"""

from __future__ import annotations

import gin

from dpjax.data.readers.malformed import MalformedLineError  # noqa: F401
from dpjax.data.readers.msmarco import (  # noqa: F401  (tests/test_trainer.py)
    DEFAULT_SAMPLE_DIR,
    load_collection_ids,
)
from tasks import msmarco
from tasks import multidogo
from tasks import pretraining
from tasks import semparse
from tasks import textcls
from tasks.msmarco import (  # noqa: F401  (re-exported)
    DEFAULT_TASK_NAME,
    DEFAULT_VOCABULARY_PATH,
    TASK_FEATURE_LENGTHS,
    register_msmarco_query_generation,
)
from tasks.semparse import (  # noqa: F401  (re-exported)
    register_semparse_task,
    register_semparse_tasks,
)


@gin.configurable(denylist=["tokenizer_files"])
def register_tasks(msmarco_query_generation: bool = True,
                   msmarco_dual_encoder: bool = True,
                   semparse_tasks: bool = True,
                   multidogo_tasks: bool = True,
                   textcls_tasks: bool = True,
                   pretraining_task: bool = True,
                   tokenizer_files: dict | None = None) -> list[str]:
  """Registers the project's seqio tasks; returns their names.

  Idempotent: re-registering replaces the previous registration, so it picks
  up the current gin bindings of each registration function.
  `tokenizer_files` are those of a pretrained checkpoint
  (`dpjax.pretrained.tokenizer_files`): its vocabulary is the default where a
  task's vocabulary is not set explicitly.
  """
  files = tokenizer_files or {}
  names = []
  if msmarco_query_generation:
    names.append(msmarco.register_msmarco_query_generation(
        checkpoint_vocabulary_path=files.get("sentencepiece")).name)
  if msmarco_dual_encoder:  # (query, passage) pairs of a retriever
    names.append(msmarco.register_msmarco_dual_encoder(
        checkpoint_vocabulary_path=files.get("sentencepiece")).name)
  if semparse_tasks:  # SMCalFlow / TreeDST (see tasks.semparse)
    names += [t.name for t in semparse.register_semparse_tasks(
        checkpoint_tokenizer_files=files)]
  if multidogo_tasks:  # MultiDoGo dialogs (see tasks.multidogo)
    names += [t.name for t in multidogo.register_multidogo_tasks(
        checkpoint_tokenizer_files=files)]
  if textcls_tasks:  # label-conditioned SST-2 / AG News (see tasks.textcls)
    names += [t.name for t in textcls.register_textcls_tasks(
        checkpoint_tokenizer_files=files)]
  if pretraining_task:  # the one `register_pretraining_task.name` names
    task = pretraining.register_pretraining_task()
    names += [task.name] if task else []
  return names
