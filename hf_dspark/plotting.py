"""matplotlib is optional: the commands that draw a plot (`bench`, `eval`, `calibrate`) write their tables and JSON
without it, and say in one line which plot they skipped and how to get it."""

from __future__ import annotations

import sys
from pathlib import Path

PLOTS_HINT = "pip install matplotlib, the package's plots extra"


def pyplot(path: str | Path):
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` when matplotlib is not installed, after one
    line on stderr naming the plot ``path`` that is skipped."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so {path} is not drawn ({PLOTS_HINT})", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
