"""The ``gpudiag`` command line.

Every command module in gpudiag.commands registers itself on the one Typer
app. User-facing failures (GpudiagError, usage errors) become one line on
stderr and exit code 2; an unexpected exception becomes one line naming it
(GPUDIAG_DEBUG=1 shows the traceback) and exit code 70.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import typer

from gpudiag import __version__, commands
from gpudiag.errors import GpudiagError

app = typer.Typer(
    name="gpudiag",
    help="GPU observability and diagnostics for LLM inference and training nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool):
    if value:
        typer.echo(f"gpudiag {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    """GPU observability and diagnostics for LLM inference and training nodes."""


def _load_commands() -> None:
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_load_commands()


# Set by a command that leaves gigabytes of arrays behind (a day's investigation): the process
# then exits without freeing them one by one, which took ~0.5 s after a day's window was
# printed. Output is flushed and logging shut down first; nothing else is pending at exit.
_skip_teardown = False


def skip_teardown() -> None:
    """Let the console script exit without freeing the process's objects (see _skip_teardown)."""
    global _skip_teardown
    _skip_teardown = True


def error_line(message: str) -> None:
    """Write one error line to stderr."""
    sys.stderr.write(f"gpudiag: error: {message}\n")
    sys.stderr.flush()


def _click_exit(exc: BaseException) -> int | None:
    """Exit code for click's own exceptions (Typer vendors click, so match by class name)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if "NoArgsIsHelpError" in names or "NoArgsIsHelp" in names:
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        return 0
    if "UsageError" in names:
        error_line(exc.format_message())
        return 2
    if "Exit" in names:
        return getattr(exc, "exit_code", 0)
    if "Abort" in names:
        error_line("aborted")
        return 130
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns (and exits with) the exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        rv = app(args=args, prog_name="gpudiag", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except GpudiagError as exc:
        error_line(str(exc))
        code = exc.exit_code
    except KeyboardInterrupt:
        error_line("interrupted")
        code = 130
    except BrokenPipeError:
        code = 0
    except Exception as exc:
        code = _click_exit(exc)
        if code is None:  # a bug: one line, the traceback only on request
            if os.environ.get("GPUDIAG_DEBUG"):
                raise
            error_line(f"internal error: {type(exc).__name__}: {exc} (set GPUDIAG_DEBUG=1 for the traceback)")
            code = 70
    if argv is None:
        if _skip_teardown:
            import logging

            try:
                sys.stdout.flush()
            except BrokenPipeError:
                pass
            sys.stderr.flush()
            logging.shutdown()
            os._exit(code)
        sys.exit(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    main()
