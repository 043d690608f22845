"""Issue 33, the Python side: an engine that exits while a daemon thread waits in
UpdateReceiver.receive() ends cleanly (no abort, no leak report), cancel() stops such a wait,
and UpdateSender.send takes what weightstream.load(framework="numpy") returns (BF16 as raw
uint8 bytes) as LoadSession.load does, without the caller naming the dtype."""
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import CLI, requires_cli, cold_layout, parameter_bytes

np = pytest.importorskip("numpy")
weightstream = pytest.importorskip("weightstream")

pytestmark = requires_cli


def synth(directory, seed, layers=1):
    subprocess.run([CLI, "synth", str(directory), "--arch", "llama", "--layers", str(layers), "--hidden", "64",
                    "--seed", str(seed)], check=True, capture_output=True)
    return str(directory)


def test_send_takes_raw_bf16_arrays_of_a_numpy_load(tmp_path):
    old = synth(tmp_path / "old", 1)
    new = synth(tmp_path / "new", 2)
    live = cold_layout(old)
    expected = parameter_bytes(cold_layout(new))
    tensors = weightstream.load(new, framework="numpy")
    raw = [name for name, array in tensors.items() if array.dtype == np.uint8]
    assert raw, "a BF16 checkpoint loads as raw uint8 bytes with numpy"
    name = raw[0]
    assert tensors[name].shape[-1] == 2 and tensors[name].ndim >= 2

    receiver = weightstream.UpdateReceiver(live, token="t", timeout=30.0)
    reports = []
    thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=60.0)))
    thread.start()
    sender = weightstream.UpdateSender(receiver.address, token="t", bucket_bytes=1 << 20)
    sender.update(tensors)  # no dtypes: the bytes say what they are
    thread.join(timeout=60)
    assert reports and reports[0]["tensors"] == len(tensors)
    assert parameter_bytes(live) == expected


def test_send_still_refuses_plain_uint8_that_does_not_fit(tmp_path):
    live = cold_layout(synth(tmp_path / "a", 1))
    receiver = weightstream.UpdateReceiver(live, token="t", timeout=30.0)
    errors = []

    def receive():
        try:
            receiver.receive(accept_timeout=60.0)
        except weightstream.Error as error:
            errors.append(str(error))

    thread = threading.Thread(target=receive)
    thread.start()
    sender = weightstream.UpdateSender(receiver.address, token="t", bucket_bytes=1 << 20)
    # uint8 bytes weightstream did not hand out carry no dtype: declared as the U8 they are,
    # and refused by the receiver before anything is sent.
    with pytest.raises(weightstream.Error, match=r"tensor model.norm.weight has shape \[64, 2\] but parameter"):
        sender.update({"model.norm.weight": np.zeros((64, 2), dtype=np.uint8)})
    thread.join(timeout=60)
    assert errors and "model.norm.weight" in errors[0]


def test_cancel_stops_a_receive_in_another_thread(tmp_path):
    live = cold_layout(synth(tmp_path / "a", 1))
    receiver = weightstream.UpdateReceiver(live, token="t")
    errors = []

    def receive():
        try:
            receiver.receive(accept_timeout=600.0)
        except weightstream.Error as error:
            errors.append(error)

    thread = threading.Thread(target=receive)
    thread.start()
    receiver.cancel()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert errors and errors[0].code == "cancelled"
    assert "cancelled while waiting for a sender to connect" in str(errors[0])


# An engine's shape: a receiver thread left waiting (20 idle peers connected, as a fault probe
# did) when the interpreter exits. With a short accept timeout the thread keeps coming back
# for the GIL, which the finalizing interpreter answers with pthread_exit() inside a noexcept
# destructor: before, "terminate called without an active exception" (abort) in 10 runs of
# 20, and nanobind's leak report of the objects the thread held.
EXIT_WHILE_RECEIVING = textwrap.dedent("""
    import socket, sys, threading
    import weightstream
    checkpoint = weightstream.open(sys.argv[1])
    layout = weightstream.model_layout(checkpoint, device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()
    receiver = weightstream.UpdateReceiver(layout, token="t")
    host, port = receiver.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(20)]
    started = threading.Event()
    def serve():
        started.set()
        while True:
            try:
                receiver.receive(accept_timeout=float(sys.argv[2]))
            except weightstream.Error:
                pass  # no sender in time: wait again
    threading.Thread(target=serve, daemon=True).start()
    started.wait()
    print("exiting", flush=True)
""")


@pytest.mark.parametrize("accept_timeout", ["0.01", "600"])
def test_exit_while_a_thread_receives_is_clean(tmp_path, accept_timeout):
    checkpoint = synth(tmp_path / "a", 1)
    script = tmp_path / "engine.py"
    script.write_text(EXIT_WHILE_RECEIVING)
    runs = int(os.environ.get("WS_EXIT_RUNS", "10"))
    for run in range(runs):
        result = subprocess.run([sys.executable, str(script), checkpoint, accept_timeout], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, f"run {run}: exit {result.returncode}: {result.stderr}"
        assert result.stdout == "exiting\n"
        assert result.stderr == "", f"run {run}: {result.stderr}"
