"""`python -m llamapy` runs the CLI."""

from .cli import main

main()
