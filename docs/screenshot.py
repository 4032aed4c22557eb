"""Screenshot real reports for the README, with the same headless-Chromium check the browser test runs.

    python docs/screenshot.py /tmp/validate.html docs/validate.png

Each PAGE is opened at a laptop's viewport (1366×768) and checked as tests/runs/test_browser.py checks
every report (no console errors, nothing fetched from outside the file, every plot drawn, nothing
blank); only a page that passes is saved, as a whole-page PNG scaled to 1025 px wide. The README's
pictures come from real runs (`memplan validate --html`, a `memplan train` run's report.html), not
from the made-up data the test builds its pages from.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_browser import DOCS_SCALE, Chromium, check_page, chromium_path, problems  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) < 2 or len(argv) % 2:
        print("usage: python docs/screenshot.py PAGE.html OUT.png [PAGE.html OUT.png ...]", file=sys.stderr)
        return 2
    executable = chromium_path()
    if executable is None:
        print("no Chromium found (apt-get install -y chromium)", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as profile:
        browser = Chromium(executable, Path(profile))
        try:
            for page, out in zip(argv[::2], argv[1::2]):
                check = check_page(browser, Path(page), page_scale=DOCS_SCALE)
                found = problems(check)
                if found:
                    print(f"{page}: not saved: {'; '.join(found)}", file=sys.stderr)
                    failed += 1
                    continue
                Path(out).write_bytes(check.page_png)
                print(f"{page} -> {out} ({len(check.plots)} plots, {len(check.page_png) / 1e3:.0f} kB)")
        finally:
            browser.quit()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
