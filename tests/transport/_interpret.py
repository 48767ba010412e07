"""Run a test script in a fresh Python with ``TRITON_INTERPRET=1`` (set before triton is imported)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``script`` under Triton's interpreter, from the repository root; stdout and stderr as text."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


# Triton <= 3.6's interpreter under NumPy 2 cannot bound range() by a tensor (int() of a
# 1-element array); Triton 3.9 can. A script that meets it cannot say anything about the kernel.
_INTERPRETER_LIMIT = "only 0-dimensional arrays can be converted"


def assert_interpreted_ok(script: str, marker: str) -> None:
    """Run ``script`` under the interpreter and require ``marker`` in its output; skip when this
    Triton's interpreter cannot run the kernel's loop at all."""
    out = run_interpreted(script)
    if _INTERPRETER_LIMIT in out.stderr:
        pytest.skip("this Triton's interpreter cannot bound range() by a tensor under this NumPy (fixed in 3.9)")
    assert marker in out.stdout, out.stdout + out.stderr
