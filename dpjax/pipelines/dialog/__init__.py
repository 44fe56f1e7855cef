"""Domain-private dialog models (Kabra & Elenberg, Findings of EMNLP 2023,
arXiv 2305.14208): redaction policies (`redaction`) and the classifier policy's
model (`classifier`)."""
