"""What differs between the Python versions memplan runs on (3.10 to 3.13).

``tomllib`` is in the standard library from 3.11; on 3.10 the same parser is the ``tomli`` package
(a dependency there only), with the same ``loads`` and ``TOMLDecodeError``.
"""

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the 3.10 resource test
    import tomli as tomllib

__all__ = ["tomllib"]
