"""Generator of the embedded AirDialogue- and Europarl-format samples of
SeqPATE (see ``generate.py``).

The generated files live in ``tasks/data/seqpate_sample/``; regenerate them
with ``python -m tasks.seqpate_sample.generate``.
"""
