"""Output writers. Each takes a (transformed) index and writes one output format atomically."""
