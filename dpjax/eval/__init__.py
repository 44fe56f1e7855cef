"""Evaluation of the retrieval pipeline (Carranza et al., NAACL 2024, arXiv
2305.05973, section 6).

* `ir_data`: MSMARCO and BEIR-format datasets from local directories;
* `encoding`: tokenization and batched, sharded encoding; the resumable
  corpus encoder writing embeddings in shards;
* `search`: exact top-k search streamed over the embedding shards;
* `ir_metrics`: NDCG@10 / Recall@10 / MRR@10 (trec_eval through
  pytrec_eval) and TREC run files;
* `retrieval`: the job, `python -m dpjax.eval.retrieval`;
* `text_quality`: BLEU, MAUVE and n-gram memorisation of synthetic queries.

No module here imports TensorFlow: texts are tokenized with SentencePiece
directly and datasets are read with the `tasks.msmarco` readers.
"""
