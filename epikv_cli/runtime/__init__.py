"""Running a model under a budget cache: sessions (hooks), the decode step, generation and batching."""
