"""Downstream utility of synthetic text-classification data (shared/papers/002,
Sec. 6): `classifier` trains a BERT-style classifier on (synthetic) labelled
texts and measures its accuracy on the real held-out split. The n-gram
memorisation rate of Sec. 6.1 is `dpjax.eval.text_quality.ngram_memorization`
(the paper's "proportion of n-grams (n in 3..7) in the synthesized data
present in the original dataset")."""
