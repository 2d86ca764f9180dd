"""The command line (llama.cpp's tools: llama-cli/llama-completion, llama-tokenize,
llama-perplexity, llama-bench, gguf-dump). The only part of llamapy that writes to the terminal:
generated text goes to stdout, flushed as it comes; logs, progress bars and timings to stderr.

Every LlamapyError becomes one line `error: …` on stderr and exit status 1; a traceback is shown
only with LLAMAPY_DEBUG=1. Ctrl-C exits with 130.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="llama.cpp's inference stack in Python: run GGUF models on CPU and GPU.",
)


def log(msg: str = "") -> None:
    """A line on stderr (logs, load summary, timings)."""
    print(msg, file=sys.stderr, flush=True)


def debug_enabled() -> bool:
    return os.environ.get("LLAMAPY_DEBUG", "0") not in ("", "0")


def main(argv: list[str] | None = None) -> Any:
    """Console entry point: maps errors to one line and an exit status."""
    from ..types import LlamapyError

    # import the command modules: each registers its commands on `app`
    from . import batch, bench, info, perplexity, run, serve  # noqa: F401

    try:
        rc = app(args=argv, standalone_mode=False)
    except LlamapyError as e:
        if debug_enabled():
            raise
        log(f"error: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
    except OSError as e:
        if debug_enabled():
            raise
        log(f"error: {e.strerror or e}: {getattr(e, 'filename', '') or ''}".rstrip(": "))
        sys.exit(1)
    except _click_exceptions() as e:  # usage errors: click's own one-line message
        e.show()
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - never a traceback unless asked for
        if debug_enabled():
            raise
        log(f"error: internal error: {type(e).__name__}: {e} (run with LLAMAPY_DEBUG=1 for a traceback)")
        sys.exit(1)
    if isinstance(rc, int) and rc:
        # click turns a Ctrl-C outside our own handlers into a returned 130
        if rc == 130:
            log("interrupted")
        sys.exit(rc)
    return rc


def _click_exceptions() -> type[Exception]:
    import click

    return click.ClickException  # type: ignore[return-value]
