"""Ctrl-C interrupts a long load: the library stops its readers when the progress callback
the binding passes (which runs Python's signal handlers) raises, and KeyboardInterrupt
reaches the caller instead of the load running to its end."""
import json
import os
import signal
import threading
import time

import pytest

weightstream = pytest.importorskip("weightstream")

# Many small reads on one reader, each a system call (io pread: a copy out of a mapping would
# run ten times faster on a quiet machine): slow enough that an interrupt lands mid-load.
SLOW = {"concurrency": 1, "memory_limit": "64KiB", "chunk_size": "4KiB", "io": "pread"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """2 GiB of zeros, written sparse (a header, then a hole), so it costs no disk time."""
    directory = tmp_path_factory.mktemp("interrupt")
    count, shape = 128, (2048, 2048)
    each = shape[0] * shape[1] * 4
    header = {f"layer.{i}.weight": {"dtype": "F32", "shape": list(shape), "data_offsets": [i * each, (i + 1) * each]}
              for i in range(count)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = directory / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + count * each)
    return str(directory)


def interrupted_after(seconds, call):
    """Runs `call` with a SIGINT sent to this process after `seconds`; returns how long it ran.
    Python's own handler (KeyboardInterrupt) is installed meanwhile: a process a shell starts in
    the background (`cmd &`, as scripts and CI drivers do) inherits SIGINT ignored, and Python
    then leaves it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    return time.monotonic() - start


@pytest.mark.parametrize("operation", ["load", "digest"])
def test_ctrl_c_interrupts_a_long_call(checkpoint, operation):
    opened = weightstream.open(checkpoint)
    call = lambda: getattr(opened, operation)(**SLOW)  # noqa: E731
    call()  # the first call also faults the file into the page cache
    start = time.monotonic()
    call()
    whole = time.monotonic() - start
    # The signal lands at a tenth of the call, leaving 90% of it (0.36 s or more) to spare.
    if whole < 0.4:
        pytest.skip(f"the whole {operation} took only {whole:.2f} s here: too fast to interrupt reliably")
    ran = interrupted_after(whole / 10, call)
    # Cancelled within a few progress ticks (100 ms each) of the signal, not at the end.
    assert ran < whole / 10 + 0.3 + whole / 4, f"{operation}: interrupted after {ran:.2f} s of {whole:.2f} s"
    # The module still works after an interrupted call.
    assert len(opened.digest(hash="xxh64")) == 128
