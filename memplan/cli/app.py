"""The ``memplan`` typer app itself (``app``), its one-line errors and ``--version``; the commands register on
it from their own modules (``memplan.cli`` imports them all).
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

try:  # typer >= 0.29 runs on its own copy of click, whose exceptions are not click's
    from typer._click import exceptions as click_exceptions
except ImportError:  # older typer runs on click itself
    from click import exceptions as click_exceptions

from memplan.errors import EnvironmentFailure, InputError


class _OneLineErrors(TyperGroup):
    """Runs the app in click's non-standalone mode so every error prints as one line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name or "memplan", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except InputError as e:
            _fail(str(e))
        except EnvironmentFailure as e:  # the machine failed (a full disk): one line, exit 1
            _fail(str(e), code=1)
        except click_exceptions.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `memplan` alone: the help is the answer
                print(e.format_message())
                sys.exit(0)
            where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            _fail(f"{e.format_message()}{where}")
        except click_exceptions.ClickException as e:
            _fail(e.format_message())
        except getattr(click_exceptions, "Abort", KeyboardInterrupt):  # typer's own click copy has no Abort
            print("memplan: aborted", file=sys.stderr)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


def _fail(message: str, code: int = 2) -> None:
    message = " ".join(str(message).split())  # exactly one line
    print(f"memplan: error: {message}", file=sys.stderr)
    sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors,
    name="memplan",
    help="Plan memory and step time for training a language model, then train on the plan and check it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def version() -> str:
    """memplan's version: the installed distribution's (importlib.metadata), else memplan.__version__
    (a source tree that is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("memplan")
    except metadata.PackageNotFoundError:
        from memplan import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        print(f"memplan {version()}")
        raise typer.Exit()


@app.callback()
def _group(
    show_version: bool = typer.Option(False, "--version", help="Print memplan's version and exit.",
                                      callback=_print_version, is_eager=True),
) -> None:
    # A typer app with a single command and no callback collapses into that bare command (no
    # `memplan NAME`, no _OneLineErrors); this callback keeps `app` a group however many
    # commands are registered, and carries --version.
    pass
