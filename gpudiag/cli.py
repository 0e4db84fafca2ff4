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

_app = typer.Typer(
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


@_app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    """GPU observability and diagnostics for LLM inference and training nodes."""


_loaded: set[str] = set()


def _load_commands(args: list[str] | None = None) -> None:
    """Register the commands: only the one ``args`` names when a module of that name has it, else all.

    Each command module is named after its command; importing all of them (and what they
    import) took ~0.3 s of every invocation, `gpudiag investigate` at 3 a.m. included.
    """
    names = sorted(m.name for m in pkgutil.iter_modules(commands.__path__))
    first = next((a for a in args or () if not a.startswith("-")), None)
    if first in names and not any(a in ("--help", "-h") for a in args[:args.index(first)]):
        names = [first]
    for name in names:
        if name in _loaded:
            continue
        _loaded.add(name)
        module = importlib.import_module(f"{commands.__name__}.{name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(_app)


def __getattr__(name: str):
    if name == "app":  # the whole command line, every command registered (for tools and tests)
        _load_commands()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        _load_commands(args)
        rv = _app(args=args, prog_name="gpudiag", standalone_mode=False)
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

            sys.stdout.flush()  # a closed pipe already failed the command's own write, and emptied the buffer
            sys.stderr.flush()
            logging.shutdown()
            os._exit(code)
        sys.exit(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    main()
