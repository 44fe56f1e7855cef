"""The five research pipelines (retrieval, semparse, seqpate, textcls,
dialog) and what they share (`harness`). They import the data layer and the
seqio tasks; the engine never imports them."""
