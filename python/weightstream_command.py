"""The ``weightstream`` command of the wheel: the console script pip writes runs main(),
which replaces this process with the compiled command the wheel carries at
``weightstream/bin/weightstream`` (its bundled libraries beside the package, found through
its run path), with the same arguments, environment, standard streams and exit status.

It sits beside the ``weightstream`` package, not inside it, so that the command starts
without importing the package (which imports torch, where installed, and the compiled core).
"""

import os
import sys


def command_path() -> str:
    """The compiled command inside the installed ``weightstream`` package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "weightstream", "bin", "weightstream")


def main() -> None:
    path = command_path()
    if not os.access(path, os.X_OK):
        sys.exit(f"weightstream: the command is not installed at {path}: this package was built "
                 "without it (a wheel from scripts/build-wheel.sh carries it)")
    # argv[0] stays what the user typed, so usage lines name the command as it was run.
    os.execv(path, [sys.argv[0], *sys.argv[1:]])


if __name__ == "__main__":
    main()
