"""The label-conditioned generation experiments of shared/papers/002
(`python -m dpjax.textcls table1|table4`); see `experiment`."""
