"""The ``memplan`` command line: one thin typer app (``memplan.cli.app``); each command lives in its own module
here and registers on the app when imported.

Library code returns data; only this package prints (rich tables, progress, JSON).
Bad input (``InputError``, or a usage error from click) is one line on stderr and exit code 2.
"""

from __future__ import annotations

from memplan.cli.app import app, click_exceptions, version  # noqa: F401  (what callers import from memplan.cli)

# Each module registers its command(s) on ``app`` at import. Heavy imports (torch) stay inside
# the command functions, so `memplan estimate` never loads torch.
import memplan.cli.autotune  # noqa: E402,F401
import memplan.cli.calibrate  # noqa: E402,F401
import memplan.cli.estimate  # noqa: E402,F401
import memplan.cli.eval  # noqa: E402,F401
import memplan.cli.export  # noqa: E402,F401
import memplan.cli.finetune  # noqa: E402,F401
import memplan.cli.generate  # noqa: E402,F401
import memplan.cli.prepare  # noqa: E402,F401
import memplan.cli.profiles  # noqa: E402,F401
import memplan.cli.sweep  # noqa: E402,F401
import memplan.cli.trace  # noqa: E402,F401
import memplan.cli.train  # noqa: E402,F401
import memplan.cli.validate  # noqa: E402,F401
from memplan.cli.fit import tidy_help  # noqa: E402

tidy_help(app)  # help lines on one line each, whatever the docstrings' line breaks


def main() -> None:
    app()
