"""The one exception type that means "the user asked for something we cannot accept"."""


class InputError(ValueError):
    """Bad input from the user: the CLI prints the message on one line and exits 2.

    The message names the problem and the accepted values, e.g.
    ``--ctx: '8q' is not a count; use an integer such as 8192 or 8k``.
    """
