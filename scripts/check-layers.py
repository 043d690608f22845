#!/usr/bin/env python3
"""Checks the include rules docs/ARCHITECTURE.md states, reading its table of layers.

Layers, in the table's order, may use only the layers above them. For a file of layer L
(src/L/..., or the public header of L under include/weightstream/):
  - a public header of layer M (`#include "weightstream/H.hpp"`, M read from the table's
    "public header" column) needs M at or above L;
  - an internal header `#include "M/..."` needs M == L, or M == base, or M above L with the
    header in src/M/shared/ (the internals M shares with the layers below it) or M a layer
    whose "public header" cell says "every header is shared" (a layer that exists to be
    shared, such as net).
Every violation is printed as FILE:LINE with the rule it breaks; the exit status is 1 if
there is any. Usage: scripts/check-layers.py [REPOSITORY_ROOT]
"""
import os
import re
import sys

INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')


SHARED_WHOLE = "every header is shared"


def read_layers(architecture_text):
    """(layer names in order, {public header file: layer}, {layers shared whole}) from the
    table of layers."""
    layers, public, shared_whole = [], {}, set()
    for line in architecture_text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"`[a-z]+`", cells[0]):
            continue
        layer = cells[0].strip("`")
        layers.append(layer)
        if SHARED_WHOLE in cells[2]:
            shared_whole.add(layer)
        for header in re.findall(r"`([a-z_]+\.hpp)`", cells[2]):
            public[header] = layer
    return layers, public, shared_whole


def layer_of(path):
    """The layer a source or public header belongs to, or None."""
    parts = path.split(os.sep)
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    return None


def violations(root, layers, public, shared_whole=frozenset()):
    rank = {layer: index for index, layer in enumerate(layers)}
    found = []

    def check(path, layer):
        with open(os.path.join(root, path), encoding="utf-8") as source:
            for number, line in enumerate(source, 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                included = match.group(1)
                where = f"{path}:{number}: \"{included}\""
                top = included.split("/")[0]
                if top == "weightstream":
                    header = included.split("/", 1)[1]
                    owner = public.get(header)
                    if owner is None:
                        found.append(f"{where}: a public header no layer of docs/ARCHITECTURE.md names")
                    elif rank[owner] > rank[layer]:
                        found.append(f"{where}: layer {layer} uses {owner}, a layer below it")
                    continue
                if top not in rank or top in (layer, "base"):
                    continue
                if rank[top] > rank[layer]:
                    found.append(f"{where}: layer {layer} uses {top}, a layer below it")
                elif not included.startswith(f"{top}/shared/") and top not in shared_whole:
                    found.append(f"{where}: an internal header of layer {top} (only {top}/shared/ is meant for other layers)")

    for directory, _, files in os.walk(os.path.join(root, "src")):
        for name in sorted(files):
            if not name.endswith((".cpp", ".hpp", ".cu", ".cuh")):
                continue
            path = os.path.relpath(os.path.join(directory, name), root)
            layer = layer_of(path)
            if layer in rank:
                check(path, layer)
    include_dir = os.path.join(root, "include", "weightstream")
    for name in sorted(os.listdir(include_dir)):
        if name in public:
            check(os.path.join("include", "weightstream", name), public[name])
        elif name.endswith(".hpp"):
            found.append(f"include/weightstream/{name}: a public header no layer of docs/ARCHITECTURE.md names")
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with open(os.path.join(root, "docs", "ARCHITECTURE.md"), encoding="utf-8") as architecture:
        layers, public, shared_whole = read_layers(architecture.read())
    if not layers:
        sys.exit("check-layers: no table of layers in docs/ARCHITECTURE.md")
    found = violations(root, layers, public, shared_whole)
    for line in found:
        print(line)
    print(f"check-layers: {len(found)} violation(s) of the include rules of docs/ARCHITECTURE.md "
          f"({', '.join(layers)})")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
