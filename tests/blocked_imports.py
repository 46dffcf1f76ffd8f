"""Run code in a fresh interpreter in which some packages cannot be imported (STYLE pattern 2: ops and
backends must import, and explain themselves, without their optional dependencies)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_without(packages: tuple[str, ...], code: str) -> str:
    """Run ``code`` with every import of ``packages`` (and their submodules) failing; return its stdout."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {tuple(packages)!r}:\n"
        "            raise ImportError('blocked for this test: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
