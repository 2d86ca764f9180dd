"""`llamapy bench` (being written; see the issue tracker)."""
