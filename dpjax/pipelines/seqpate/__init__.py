"""SeqPATE (Tian et al., NeurIPS 2022): PATE for text generation.

Private sentences are split among many GPT-2 teachers (`partition`), which
are trained a vmapped group at a time and cache their top-k next-token
distributions on the public pseudo-data (`teachers`, `cache`; pseudo-data
from `pseudo_data`). The student's queries are answered by the noisy
aggregation (`aggregation`), each (sentence, position) noised once and
stored, and charged to a `PrivacyLedger` (`accounting`).
`noisysgd` runs the paper's DP-SGD baseline through dpjax's trainer, and
`experiment` (`python -m dpjax.pipelines.seqpate table1`) the Table 1 and ablation
rows. `python -m dpjax.pipelines.seqpate.bench` times vmapped against one-at-a-time
teacher training.

Nothing here imports TensorFlow (the trainer imports the data layer when the
NoisySGD baseline runs).
"""
