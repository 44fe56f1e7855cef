"""Text formats: Lispress programs and the redaction of private spans."""
