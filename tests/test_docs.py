"""The documentation runs: every code block of README.md and docs/*.md fenced as ```python cpu executes on the
CPU (a fresh interpreter each, the repository on PYTHONPATH, no MOE_KERNELS_EMULATE, no GPU visible) and exits
0; its own asserts check its results. Relative links between the pages point at files and headings that exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "python cpu"  # the fence's info string
FENCE = re.compile(r"^```([^`\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def fences(page: Path):
    """(line, info string, code) of each fenced block of `page`."""
    text = page.read_text()
    for m in FENCE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2)


def runnable_blocks():
    return [pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}")
            for page in PAGES for line, info, code in fences(page) if info == RUNNABLE]


def test_the_pages_exist_and_mark_their_runnable_blocks():
    assert (ROOT / "docs" / "index.md") in PAGES
    marked = {page.name: [info for _, info, _ in fences(page) if info == RUNNABLE] for page in PAGES}
    assert marked["README.md"], "README.md has no runnable example"
    for page in PAGES:
        for line, info, _ in fences(page):
            # A misspelt marker would silently take a block out of the test.
            assert info == RUNNABLE or "cpu" not in info, f"{page.name}:{line}: fence {info!r}; runnable is {RUNNABLE!r}"


@pytest.mark.parametrize("code", runnable_blocks())
def test_runnable_block(code, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_KERNELS_EMULATE", "MOE_KERNELS_TEST_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    script = tmp_path / "block.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_gives_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "\npip install -e . && moe-train\n" in readme
    tests = 'pip install -e ".[test]" && python -m pytest -q -n auto'
    assert f"\n{tests}\n" in readme and tests in (ROOT / ".ci" / "run").read_text()
    # A newcomer's page: the reference lives in docs/.
    assert len(readme.splitlines()) < 200
