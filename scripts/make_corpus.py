"""Builds the embedded default training corpus: docstrings of the CPython standard library.

Docstrings are read with `ast` (nothing is imported). The text is PSF-licensed (see
moe_kernels/train/data/NOTICE). Run once; the result is committed:

    python scripts/make_corpus.py moe_kernels/train/data/corpus.txt.gz
"""

import ast
import gzip
import inspect
import sys
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "pydoc_data",
             "__pycache__", "tkinter", "distutils"}
TARGET_BYTES = 1_500_000


def docstrings(path: Path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 120 and doc.isascii() and ">>>" not in doc:
                yield inspect.cleandoc(doc)


def main(out: str) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        for doc in docstrings(path):
            chunks.append(doc)
            size += len(doc) + 2
        if size >= TARGET_BYTES:
            break
    text = "\n\n".join(chunks) + "\n"
    with gzip.open(out, "wt", encoding="ascii", compresslevel=9) as f:
        f.write(text)
    print(f"{out}: {len(text):,} characters from Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main(sys.argv[1])
