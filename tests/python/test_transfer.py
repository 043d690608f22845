"""Pushed updates from Python (issue 8): a trainer-side UpdateSender pushes a checkpoint's
tensors over TCP and shared memory to an UpdateReceiver applying them to a live ModelLayout.
The result must equal a cold load of the same weights bit for bit, with storage addresses
unchanged and the model hook run once per update."""
import subprocess
import threading

import pytest
from conftest import CLI, requires_cli, cold_layout, parameter_bytes

np = pytest.importorskip("numpy")
weightstream = pytest.importorskip("weightstream")

pytestmark = requires_cli


def synth(directory, seed):
    subprocess.run([CLI, "synth", str(directory), "--arch", "llama", "--layers", "2", "--seed", str(seed)],
                   check=True, capture_output=True)
    return weightstream.open(str(directory))


def manifest(checkpoint):
    """(name, dtype, shape) of every tensor of `checkpoint`: what an update of all of it declares."""
    return [(name, checkpoint.dtypes[name], checkpoint.shapes[name]) for name in checkpoint.names]


def parameter_addresses(layout):
    return {name: np.from_dlpack(layout.tensor(name)).ctypes.data for name in layout.parameter_names}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pushed_update_equals_a_cold_load_in_place(tmp_path, transport):
    old = synth(tmp_path / "old", 1)
    new = synth(tmp_path / "new", 2)
    live = cold_layout(old)
    hook_runs = []
    live.add_hook("count", lambda: hook_runs.append(1))
    addresses = parameter_addresses(live)
    expected = parameter_bytes(cold_layout(new))
    assert parameter_bytes(live) != expected

    receiver = weightstream.UpdateReceiver(live, transport=transport, token="s3cret", timeout=30.0)
    reports = []
    thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=60.0)))
    thread.start()
    sender = weightstream.UpdateSender(receiver.address, transport=transport, token="s3cret", bucket_bytes=1 << 20,
                                       share_minimum_bytes=1 << 30)
    sender.start("checkpoint", manifest(new))
    for name, tensor in new.stream(framework="numpy"):
        sender.send(name, tensor, new.dtypes[name])
    echoed = sender.finish()
    thread.join(timeout=60)
    assert not thread.is_alive() and reports
    assert parameter_bytes(live) == expected
    assert parameter_addresses(live) == addresses
    assert hook_runs == [1]
    assert echoed["connect_seconds"] > 0 and echoed["shared_bytes"] == 0 and echoed["regions"] == 0
    assert echoed["bytes"] == reports[0]["bytes"] > 0
    # Where the receiver's time went: every phase is there, and they add up to the update.
    phases = echoed["phases"]
    assert set(phases) == {"preparing", "first_bucket", "waiting", "parsing", "opening", "checking", "copying", "finishing",
                           "closing"}
    assert all(value >= 0 for value in phases.values())
    assert phases["checking"] > 0 and phases["first_bucket"] <= phases["preparing"] + phases["waiting"] + phases["parsing"]
    accounted = sum(value for key, value in phases.items() if key != "first_bucket")
    assert 0.5 * echoed["seconds"] < accounted <= echoed["seconds"] * 1.01

    # The same connection carries the next update: back to the old weights.
    thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=60.0)))
    thread.start()
    sender.start("checkpoint", manifest(old))
    for name, tensor in old.stream(framework="numpy"):
        sender.send(name, tensor, old.dtypes[name])
    again = sender.finish()
    thread.join(timeout=60)
    assert not thread.is_alive() and len(reports) == 2
    assert again["connect_seconds"] == 0.0
    assert parameter_bytes(live) == parameter_bytes(cold_layout(old))
    assert parameter_addresses(live) == addresses
    assert hook_runs == [1, 1]


def test_a_sender_without_the_token_is_refused(tmp_path):
    live = cold_layout(synth(tmp_path / "m", 3))
    receiver = weightstream.UpdateReceiver(live, transport="tcp", token="right", timeout=10.0)
    errors = []

    def receive():
        try:
            receiver.receive(accept_timeout=20.0)
        except weightstream.Error as error:
            errors.append(str(error))

    thread = threading.Thread(target=receive)
    thread.start()
    # The receiver proves first: a sender with another token stops before it sends its proof.
    with pytest.raises(weightstream.Error, match="could not prove the token") as refused:
        weightstream.UpdateSender(receiver.address, transport="tcp", token="wrong")
    assert "wrong" not in str(refused.value).replace("a wrong or missing", "")
    assert "right" not in str(refused.value)
    with pytest.raises(weightstream.Error, match="requires a token, and this side has none"):
        weightstream.UpdateSender(receiver.address, transport="tcp")
    receiver.cancel()
    thread.join(timeout=30)
    assert receiver.address.startswith("127.0.0.1:") or "127.0.0.1" in receiver.address


@pytest.mark.parametrize("token", [None, ""])
def test_a_receiver_without_a_token_refuses_to_start(tmp_path, token):
    live = cold_layout(synth(tmp_path / "m", 3))
    arguments = {} if token is None else {"token": token}
    with pytest.raises(weightstream.Error, match="refuses to start without a token") as refused:
        weightstream.UpdateReceiver(live, transport="tcp", **arguments)
    assert "open_without_token=True" in str(refused.value)
    with pytest.raises(weightstream.Error, match="both a token and an open listener"):
        weightstream.UpdateReceiver(live, transport="tcp", token="t", open_without_token=True)


def test_an_open_receiver_is_asked_for_warns_once_and_takes_a_sender_without_a_token(tmp_path, capfd):
    live = cold_layout(synth(tmp_path / "old", 1))
    new = synth(tmp_path / "new", 2)
    expected = parameter_bytes(cold_layout(new))
    capfd.readouterr()
    receiver = weightstream.UpdateReceiver(live, transport="tcp", open_without_token=True, timeout=30.0)
    reports = []
    thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=60.0)))
    thread.start()
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", bucket_bytes=1 << 20)
    sender.start("checkpoint", manifest(new))
    for name, tensor in new.stream(framework="numpy"):
        sender.send(name, tensor, new.dtypes[name])
    sender.finish()
    thread.join(timeout=60)
    assert reports and parameter_bytes(live) == expected
    warnings = [line for line in capfd.readouterr().err.splitlines() if "listens without a token" in line]
    assert warnings == [f"weightstream: warning: update receiver on {receiver.address} listens without a token "
                        f"(open_without_token): anyone who can reach it is accepted"]


def test_one_sender_feeds_several_receivers(tmp_path):
    """The tensor-parallel ranks of an engine, each a receiver: one trainer-side sender feeds them all."""
    old = synth(tmp_path / "old", 1)
    new = synth(tmp_path / "new", 2)
    ranks = [cold_layout(old), cold_layout(old)]
    expected = parameter_bytes(cold_layout(new))
    receivers = [weightstream.UpdateReceiver(live, transport="tcp", token="s3cret") for live in ranks]
    reports = []
    threads = [threading.Thread(target=lambda r=r: reports.append(r.receive(accept_timeout=60.0))) for r in receivers]
    for thread in threads:
        thread.start()
    sender = weightstream.UpdateSender([r.address for r in receivers], transport="tcp", token="s3cret",
                                       bucket_bytes=1 << 16)
    sender.start("checkpoint", manifest(new))
    for name, tensor in new.stream(framework="numpy"):
        sender.send(name, tensor, new.dtypes[name])
    echoed = sender.finish()
    for thread in threads:
        thread.join(timeout=60)
    assert len(reports) == 2 and echoed["buckets"] == reports[0]["buckets"] > 2
    assert all(parameter_bytes(live) == expected for live in ranks)
    with pytest.raises(weightstream.Error, match="2 receivers over shm, which carries one"):
        weightstream.UpdateSender([r.address for r in receivers], transport="shm")
