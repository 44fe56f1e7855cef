"""Generator of the embedded MultiDoGo-format sample (see ``generate.py``).

The generated files live in ``tasks/data/multidogo_sample/``; regenerate them
with ``python -m tasks.multidogo_sample.generate``.
"""
