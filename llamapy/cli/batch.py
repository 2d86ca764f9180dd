"""`llamapy batch` (being written; see the issue tracker)."""
