"""The label-conditioned generation experiments of an ICLR 2023 submission,
OpenReview LUql3ZOFwFD (`python -m dpjax.pipelines.textcls table1|table4`); see
`experiment`."""
