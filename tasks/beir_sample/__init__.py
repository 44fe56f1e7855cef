"""Generator of the embedded BEIR-format sample (see ``generate.py``).

The generated files live in ``tasks/data/beir_sample/``; regenerate them with
``python -m tasks.beir_sample.generate``.
"""
