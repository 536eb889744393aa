"""`python -m experiments [judge|generate|bench|convert|train_tiny|gpu_check|aot|speed] [--flags]`.

Each sub-command is a module of this package that defines its absl flags at import time and a
`main(argv)`; only the chosen module is imported, so flag names never collide.
"""

import importlib
import sys

from absl import app

COMMANDS = ("judge", "generate", "bench", "convert", "train_tiny", "gpu_check", "aot", "speed")
DEFAULT = "judge"


def _split(argv):
    if len(argv) > 1 and not argv[1].startswith("-"):
        cmd, rest = argv[1], argv[2:]
    else:
        cmd, rest = DEFAULT, argv[1:]
    if cmd not in COMMANDS:
        sys.exit(f"unknown sub-command {cmd!r}; choose one of {', '.join(COMMANDS)}")
    return cmd, rest


def main_entry():
    cmd, rest = _split(sys.argv)
    module = importlib.import_module(f"experiments.{cmd}")
    app.run(module.main, argv=[f"experiments {cmd}"] + rest)


if __name__ == "__main__":
    main_entry()
