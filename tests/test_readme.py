"""README.md is run, not just read: its Python blocks run as written on a CPU, its set-up block is exactly the
two commands CI runs (.ci/run), any other shell command it shows exits 0, and every relative link in README.md
and docs/*.md resolves to a file (and to a heading, where it names one)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_LINES = 200


def blocks(path: Path, *langs: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang in langs]


def shell_commands(body: str) -> list[str]:
    """The command lines of a shell block, comments and blank lines left out."""
    return [line.split("  #")[0].strip() for line in body.splitlines() if line.strip() and not line.startswith("#")]


def ci_commands() -> list[str]:
    """The set-up commands .ci/run runs: its lines that install the package and run the tests."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.startswith(("pip install", "python -m pytest"))]


def user_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a user on this machine: the tests' own settings (conftest.py) taken out, a fresh
    decision store, and this checkout importable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("INDUCTOR_ATTN_ROUTE_DEVICES", "INDUCTOR_ATTN_STRICT", "TRITON_INTERPRET")}
    env["INDUCTOR_ATTN_CACHE_DIR"] = str(tmp_path / "store")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_setup_block_is_what_ci_runs():
    setup = blocks(README, "bash", "sh")[0]
    assert shell_commands(setup) == ci_commands() == [
        'pip install torch==2.13.0 -e ".[dev]" && python -m inductor_attn demo',
        "python -m pytest -q -n auto",
    ]


@pytest.mark.parametrize("index", range(len(blocks(README, "python"))))
def test_python_block_runs_on_a_cpu(index, tmp_path):
    code = blocks(README, "python")[index]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=user_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README python block {index} failed:\n{code}\n{done.stdout}\n{done.stderr}"


def other_shell_commands() -> list[str]:
    return [cmd for body in blocks(README, "bash", "sh")[1:] for cmd in shell_commands(body)]


@pytest.mark.parametrize("command", other_shell_commands())
def test_shell_command_runs(command, tmp_path):
    words = shlex.split(command)
    assert words[0] == "python", f"README shows a command this test cannot run as written: {command}"
    done = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=user_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces as
    hyphens.

    >>> slug("Many ranks (`torch.distributed`)"), slug("Training (fwd+bwd)")
    ('many-ranks-torchdistributed', 'training-fwdbwd')
    """
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeated headings get -1, -2, ... as on GitHub); headings
    inside code blocks do not count."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # links shown as code are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_links_into_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages README does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hashes_in_prose(page):
    """Commit hashes belong in git and benchmarks/RESULTS.md, not in the documentation."""
    text = FENCE.sub("", page.read_text())
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not hashes, f"{page.name} names commits: {hashes}"
