"""The one exception type that means "the user asked for something we cannot accept", and the exit codes."""

# Exit codes of every command (docs/cli.md): 0 an answer; 1 an internal failure or a run that
# stopped on an error; 2 bad input (InputError); 3 answered, but nothing usable: the planner
# found nothing that fits (``autotune``), or ``--verify`` found no plan whose measured peak fits
# or did not run. A script's ``memplan autotune --out plan.toml && memplan train --plan plan.toml``
# stops at 3 instead of training an older plan.
EXIT_NOTHING_FITS = 3


class InputError(ValueError):
    """Bad input from the user: the CLI prints the message on one line and exits 2.

    The message names the problem and the accepted values, e.g.
    ``--ctx: '8q' is not a count; use an integer such as 8192 or 8k``.
    """


class EnvironmentFailure(RuntimeError):
    """The machine, not the input, failed the command: the disk is full, a write failed with an I/O error.
    The CLI prints the message on one line and exits 1 (the input may be fine to retry once the machine is).

    The message names what failed and what was left, e.g.
    ``--html: cannot write 'r.html': No space left on device (1.2 MiB free, a report needs 4.6 MiB); nothing written``.
    """
