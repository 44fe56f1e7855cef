"""Generator of the embedded SST-2 / AG News-format samples (see ``generate.py``).

The generated files live in ``tasks/data/textcls_sample/``; regenerate them
with ``python -m tasks.textcls_sample.generate``.
"""
