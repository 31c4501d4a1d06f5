"""Puts examples/parity on sys.path, so a fixture can reuse the examples' model, data and steps."""

import sys
from pathlib import Path

FOLDER = str(Path(__file__).resolve().parents[3] / "examples" / "parity")
if FOLDER not in sys.path:
    sys.path.insert(0, FOLDER)
