"""Print one of the README's two set-up commands, exactly as a user would copy it.

The commands are the first two fenced ``bash`` blocks of the README's "## Set up" section: the first
installs memplan and runs the quick start, the second installs it with the test extras and runs the
tests. CI runs what this prints, so the README and CI cannot drift apart.

    python3 .ci/readme_commands.py 1    # the quick-start command
    python3 .ci/readme_commands.py 2    # the test command
    python3 .ci/readme_commands.py litgpt      # the Tests section's command for litgpt's environment
    python3 .ci/readme_commands.py torchtune   # and torchtune's
"""

import re
import sys
from pathlib import Path


def setup_commands(readme: str) -> list[str]:
    """The one-line commands of the fenced bash blocks under "## Set up", in order."""
    match = re.search(r"^## Set up\n(.*?)(?=^## )", readme, re.S | re.M)
    if not match:
        raise SystemExit("README.md has no '## Set up' section")
    blocks = re.findall(r"^```bash\n(.*?)^```", match.group(1), re.S | re.M)
    commands = [b.strip() for b in blocks]
    if len(commands) != 2 or any("\n" in c for c in commands):
        raise SystemExit(f"README.md's Set up section must hold two one-line bash commands, found {commands!r}")
    return commands


LIBRARIES = ("litgpt", "torchtune")


def library_command(readme: str, library: str) -> str:
    """The "## Tests" section's one-line command that builds LIBRARY's environment and runs its tests."""
    match = re.search(r"^## Tests\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if not match:
        raise SystemExit("README.md has no '## Tests' section")
    lines = [line.strip() for block in re.findall(r"^```\n(.*?)^```", match.group(1), re.S | re.M)
             for line in block.splitlines() if line.startswith(f"python3 -m venv .venv-{library} ")]
    if len(lines) != 1:
        raise SystemExit(f"README.md's Tests section must hold one command for .venv-{library}, found {lines!r}")
    return lines[0]


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("1", "2", *LIBRARIES):
        raise SystemExit("usage: readme_commands.py 1|2|" + "|".join(LIBRARIES))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    print(library_command(readme, which) if which in LIBRARIES else setup_commands(readme)[int(which) - 1])
