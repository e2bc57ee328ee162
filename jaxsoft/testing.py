"""Property checks for any normalizer (being written)."""
