"""Write a calibration corpus of natural technical English from this machine: the docstrings (200
characters or more) of the Python standard library's modules, classes and functions, one JSONL
document per module. No file of the quality bench's evaluation texts is read (pydoc_data, which
holds the "docs" text, is left out, and so are the tests).

    python bench/calib_stdlib.py -o stdlib-docstrings.jsonl
    quantize --calib stdlib-docstrings.jsonl ...

(Python 3.11's library: 325 documents, 1.2 M characters.)
"""
from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

SKIP = {"site-packages", "test", "pydoc_data", "idlelib", "lib2to3", "turtledemo"}  # top-level packages left out
MIN_CHARS = 200


def documents(root: Path) -> list[str]:
    docs = []
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if parts[0] in SKIP or "tests" in parts:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = [d for node in ast.walk(tree)
                 if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and (d := ast.get_docstring(node)) and len(d) >= MIN_CHARS]
        if parts:
            docs.append("\n\n".join(parts))
    return docs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--out", type=Path, required=True, help="the JSONL file to write")
    args = p.parse_args()
    docs = documents(Path(sysconfig.get_paths()["stdlib"]))
    with open(args.out, "w") as out:
        for d in docs:
            out.write(json.dumps({"text": d}) + "\n")
    print(f"wrote {args.out}: {len(docs)} documents, {sum(map(len, docs)):,} characters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
