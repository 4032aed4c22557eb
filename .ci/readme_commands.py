"""Print one of the README's two set-up commands, exactly as a user would copy it.

The commands are the first two fenced ``bash`` blocks of the README's "## Set up" section: the first
installs memplan and runs the quick start, the second installs it with the test extras and runs the
tests. CI runs what this prints, so the README and CI cannot drift apart.

    python3 .ci/readme_commands.py 1    # the quick-start command
    python3 .ci/readme_commands.py 2    # the test command
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


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("1", "2"):
        raise SystemExit("usage: readme_commands.py 1|2")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    print(setup_commands(readme)[int(which) - 1])
