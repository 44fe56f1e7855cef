"""Domain-private dialog models (shared/papers/004): redaction policies
(`redaction`) and the classifier policy's model (`classifier`)."""
