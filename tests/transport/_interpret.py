"""Run a test script in a fresh Python with ``TRITON_INTERPRET=1`` (set before triton is imported)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``script`` under Triton's interpreter, from the repository root; stdout and stderr as text."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
