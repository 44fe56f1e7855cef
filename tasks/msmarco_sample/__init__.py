"""Generator of the embedded MSMARCO-format sample (see ``generate.py``).

The generated files live in ``tasks/data/msmarco_sample/`` and ship with the
package; regenerate them with ``python -m tasks.msmarco_sample.generate``.
"""
