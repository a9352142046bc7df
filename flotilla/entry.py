"""The console scripts' entry points: the command's module is imported here, so that a Ctrl-C while torch loads
(the first second or two) ends the command quietly (exit 130) rather than in an import's traceback."""
from __future__ import annotations

import sys


def _interruptible(module: str):
    try:
        main = getattr(__import__(module, fromlist=["main"]), "main")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    return main()


def runtime():
    return _interruptible("flotilla.server.cli")


def quantize():
    return _interruptible("flotilla.quantize.cli")
