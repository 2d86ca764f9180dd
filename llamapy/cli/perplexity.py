"""`llamapy perplexity` (being written; see the issue tracker)."""
