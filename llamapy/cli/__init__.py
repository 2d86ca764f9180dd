"""The command line (llama.cpp's tools: llama-cli/llama-completion, llama-tokenize,
llama-perplexity, llama-bench, gguf-dump). The only part of llamapy that writes to the terminal:
generated text goes to stdout, flushed as it comes; logs, progress bars and timings to stderr.

Every LlamapyError and every usage error becomes one line `error: …` on stderr and a non-zero
exit status; a traceback is shown only with LLAMAPY_DEBUG=1. Ctrl-C exits with 130, SIGTERM with
143, both after the same cleanups (no `.partial` file left); a closed stdout
(`llamapy info M | head -1`) ends quietly.

llama.cpp spells many options with one dash and several letters (`-ngl`, `-fa`, `-cnv`): such a
word is always one option here, never a cluster of one-letter options (`-fa` is not `-f a`).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from ..types import LlamapyError


class UnknownOption(LlamapyError):
    """A multi-letter single-dash word that names no option of the command."""


def _option_arity(cmd: Any, ctx: Any) -> dict[str, bool]:
    """Every option spelling of `cmd` -> whether it takes a value."""
    arity: dict[str, bool] = {name: False for name in ctx.help_option_names}
    for p in getattr(cmd, "params", ()):
        if getattr(p, "param_type_name", "") != "option":
            continue
        takes_value = not (getattr(p, "is_flag", False) or getattr(p, "count", False))
        for o in [*p.opts, *getattr(p, "secondary_opts", ())]:
            arity[o] = takes_value
    return arity


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def check_single_dash_words(cmd: Any, ctx: Any, args: list[str]) -> None:
    """Reject `-xyz` words that are no option of `cmd` before click's parser reads them as
    `-x yz` (a short option with its value glued on) or as a cluster of flags."""
    arity = _option_arity(cmd, ctx)
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            break
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            name = word.split("=", 1)[0]
            if name in arity:
                if arity[name] and "=" not in word:
                    i += 1  # its value, whatever it looks like
            elif not word.startswith("--") and len(name) > 2:
                raise UnknownOption(f"unknown option {name} (`{ctx.command_path} {cmd.name} --help` lists the options)")
        i += 1


class LlamaGroup(TyperGroup):
    """The command group: checks each command's single-dash words before click parses them."""

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[Any, Any, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None and not hasattr(cmd, "commands"):  # nested groups check their own
            check_single_dash_words(cmd, ctx, rest)
        return name, cmd, rest


app = typer.Typer(
    cls=LlamaGroup,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: whole flag names, wrapped to the terminal
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    help="llama.cpp's inference stack in Python: run GGUF models on CPU and GPU.",
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"llamapy {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version, help="print the version and exit"),
) -> None:
    """llama.cpp's inference stack in Python: run GGUF models on CPU and GPU."""


class _LogSettings:
    """--log-disable (one CLI invocation per process: the library never logs)."""

    enabled = True


def log(msg: str = "") -> None:
    """A line on stderr (logs, load summary, timings); nothing with --log-disable."""
    if _LogSettings.enabled:
        print(msg, file=sys.stderr, flush=True)


def set_logging(enabled: bool) -> None:
    _LogSettings.enabled = enabled


def error(msg: str) -> None:
    """An error line: said even with --log-disable."""
    print(f"error: {msg}", file=sys.stderr, flush=True)


def debug_enabled() -> bool:
    return os.environ.get("LLAMAPY_DEBUG", "0") not in ("", "0")


def _is_usage_error(e: BaseException) -> bool:
    """click's (or typer's vendored click's) ClickException, recognised without importing click:
    typer >= 0.29 vendors click and no longer installs it."""
    return callable(getattr(e, "format_message", None)) and isinstance(getattr(e, "exit_code", None), int)


def _usage_line(e: Any) -> str:
    msg = str(e.format_message()).strip()
    ctx = getattr(e, "ctx", None)
    if ctx is not None and "\n" not in msg:
        what = "commands" if hasattr(ctx.command, "commands") else "options"
        msg += f" (`{ctx.command_path} --help` lists the {what})"
    return msg


def _stdout_gone() -> None:
    """stdout's reader went away: send what is left to /dev/null so that the interpreter's final
    flush does not complain, and end without a word."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so that cleanups run as for Ctrl-C (a BaseException:
    no `except Exception` swallows it)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def _terminate_as_exception() -> Any:
    """Turn SIGTERM into `Terminated` for this command; returns the handler to restore (None
    when signals cannot be set here: not the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> Any:
    """Console entry point: maps errors to one line and an exit status."""
    # import the command modules: each registers its commands on `app`
    from . import batch, bench, cache, embedding, info, perplexity, run, serve  # noqa: F401

    set_logging(True)
    previous_term = _terminate_as_exception()
    try:
        rc = app(args=argv, prog_name="llamapy", standalone_mode=False)
    except Terminated:
        log("terminated")
        sys.exit(143)  # 128 + SIGTERM, after every `finally` (partial files removed) has run
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
    except BrokenPipeError:
        _stdout_gone()
        sys.exit(141)  # as a C tool killed by SIGPIPE
    except LlamapyError as e:
        if debug_enabled():
            raise
        error(str(e))
        sys.exit(1)
    except OSError as e:
        if debug_enabled():
            raise
        error(f"{e.strerror or e}: {getattr(e, 'filename', '') or ''}".rstrip(": "))
        sys.exit(1)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - never a traceback unless asked for
        if isinstance(e, typer.Abort):
            log("aborted")
            sys.exit(1)
        if _is_usage_error(e):
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `llamapy`: the help, as a usage error
                sys.stderr.write(str(e.format_message()).rstrip("\n") + "\n")
            else:
                error(_usage_line(e))
            sys.exit(e.exit_code)  # type: ignore[attr-defined]
        if debug_enabled():
            raise
        error(f"internal error: {type(e).__name__}: {e} (run with LLAMAPY_DEBUG=1 for a traceback)")
        sys.exit(1)
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
    if isinstance(rc, int) and rc:
        # click turns a Ctrl-C outside our own handlers into a returned 130
        if rc == 130:
            log("interrupted")
        sys.exit(rc)
    return rc
