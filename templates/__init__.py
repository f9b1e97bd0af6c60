"""Training programs shipped to TPU workers, and their bootstrap."""
