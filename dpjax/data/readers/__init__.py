"""Pure readers of the published datasets, below everything that uses them.

One module per dataset family: `msmarco` (passage ranking), `beir`
(zero-shot retrieval sets), `semparse` (SMCalFlow / TreeDST dataflow
dialogues), `multidogo` (MultiDoGo dialogs), `seqpate` (AirDialogue,
Europarl) and `textcls` (SST-2, AG News); `malformed` is the one policy for
bad lines they share. They import the standard library, numpy and pure text
logic (`dpjax.data.text`) only: no TensorFlow or seqio (`tasks/` registers the
seqio tasks built on them), no model, no pipeline.
"""
import pathlib

# The embedded samples are package data of `tasks` (`tasks/data/`), a
# sibling of `dpjax` both in the repository and when installed.
SAMPLE_DATA_DIR = str(
    pathlib.Path(__file__).resolve().parents[3] / "tasks" / "data")
