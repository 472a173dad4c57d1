"""`python -m pdserve.kernels.native`: build (or find) the native kernels and print where they are."""
from __future__ import annotations

import sys

from pdserve.kernels.native import NativeUnavailable, build_dir, load


def main() -> int:
    try:
        load()
    except NativeUnavailable as exc:
        print(f"native CPU kernels unavailable: {exc}", file=sys.stderr)
        return 1
    print(build_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
