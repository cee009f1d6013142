"""What the picture examples share: matplotlib, drawing to files only (the optional extra `plot`)."""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on its file backend; where matplotlib is missing, one line naming the install command and
    exit status 2."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no screen
        import matplotlib.pyplot as plt
    except ImportError:
        print("this example needs matplotlib: pip install 'llama-jax[plot]'", file=sys.stderr)
        raise SystemExit(2) from None
    return plt
