"""dpjax's data layer.

TensorFlow and seqio live only here and in the top-level `tasks` package; the
DP core (`dpjax.privacy`, `dpjax.models`, the train step) never imports them
and only receives numpy arrays. Submodules are not imported eagerly so that
`import dpjax.data` stays TensorFlow-free: use `dpjax.data.arrays`.
"""
