"""What the Python tests share: where the `weightstream` command under test is.

$WS_CLI names it (scripts/test.sh sets it to its build); a relative path is taken from the
repository root; the default is build/weightstream. Test modules either take the `cli`
fixture, or, where module-level helpers run the command, import CLI and mark the module
with `requires_cli` (pytest puts this folder on sys.path, so `from conftest import ...`
finds this file).
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli_path():
    path = Path(os.environ.get("WS_CLI", "build/weightstream"))
    return path if path.is_absolute() else ROOT / path


CLI = str(_cli_path())
_MISSING = f"the weightstream CLI is not built at {CLI} (set WS_CLI)"

# Skips a whole module (pytestmark) or one test when the command is not built.
requires_cli = pytest.mark.skipif(not Path(CLI).exists(), reason=_MISSING)


@pytest.fixture(scope="session")
def cli():
    """The command's path as a string; skips the test when it is not built."""
    if not Path(CLI).exists():
        pytest.skip(_MISSING)
    return CLI


def cold_layout(checkpoint):
    """A host layout of the checkpoint (a URI or an open Checkpoint), cold-loaded from it."""
    import weightstream  # noqa: PLC0415 - the modules that call this skip without it

    if isinstance(checkpoint, str):
        checkpoint = weightstream.open(checkpoint)
    layout = weightstream.model_layout(checkpoint, device="cpu")
    cold_load(layout, checkpoint)
    return layout


def cold_load(layout, source, **options):
    """Cold-loads `source` (a URI or an open Checkpoint) into `layout`, with load_checkpoint's
    `options` (token=...); the load's report."""
    import weightstream  # noqa: PLC0415 - the modules that call this skip without it

    session = weightstream.LoadSession(layout)
    session.begin("cold")
    report = session.load_checkpoint(source, **options)
    session.finish()
    return report


def parameter_bytes(layout):
    """Every parameter's bytes, by name."""
    import numpy as np  # noqa: PLC0415 - the modules that call this skip without it

    return {name: np.from_dlpack(layout.tensor(name)).tobytes() for name in layout.parameter_names}
