#!/usr/bin/env python3
"""Checks the sizes issue 48 sets for the library and the Python package: no function over
100 lines and no file over 800 lines in src/ and python/ (C++ .cpp, .hpp and .cu files and
Python .py files; tests live in tests/ and are not checked).

A function's length is lizard's: from the line of its name to its closing brace (Python: its
last line), comments and blank lines included. A file's length is its count of lines.
Every offender is printed as FILE:LINE with its length; the exit status is 1 if there is any.
Needs lizard (PyPI; scripts/install-deps.sh installs it).
Usage: scripts/check-sizes.py [REPOSITORY_ROOT]
"""
import os
import sys

MAX_FUNCTION_LINES = 100
MAX_FILE_LINES = 800
FOLDERS = ("src", "python")
EXTENSIONS = (".cpp", ".hpp", ".cu", ".py")
# Folders that hold no source of ours: byte code, build trees.
SKIPPED_FOLDERS = {"__pycache__", "build"}


def source_files(root):
    """The checked files under FOLDERS, as paths relative to `root`, in sorted order."""
    found = []
    for folder in FOLDERS:
        for directory, subfolders, files in os.walk(os.path.join(root, folder)):
            subfolders[:] = [name for name in subfolders if name not in SKIPPED_FOLDERS and not name.startswith(".")]
            for name in files:
                if name.endswith(EXTENSIONS):
                    found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


def offenders(root, analyze):
    """Each file over MAX_FILE_LINES and each function over MAX_FUNCTION_LINES, as a line of text.

    `analyze(path, text)` returns lizard's functions of a file (lizard has no reader for .cu
    files and falls back to its C-like one, as for .cpp)."""
    found = []
    for path in source_files(root):
        with open(os.path.join(root, path), encoding="utf-8") as source:
            text = source.read()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path}: the file is {lines} lines (at most {MAX_FILE_LINES})")
        for function in analyze(path, text):
            if function.length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{function.start_line}: {function.name} is {function.length} lines "
                             f"(at most {MAX_FUNCTION_LINES})")
    return found


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    try:
        import lizard
    except ImportError:
        print("check-sizes: lizard is not installed (python3 -m pip install lizard; scripts/install-deps.sh "
              "installs it)", file=sys.stderr)
        return 2
    found = offenders(root, lambda path, text: lizard.analyze_file.analyze_source_code(path, text).function_list)
    for line in found:
        print(line)
    print(f"{len(found)} offender(s): functions over {MAX_FUNCTION_LINES} lines, files over {MAX_FILE_LINES} lines "
          f"in {' and '.join(folder + '/' for folder in FOLDERS)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
