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
                           "verifying", "closing"}
    assert all(value >= 0 for value in phases.values())
    # (How much of the update they cover depends on how the machine schedules the receiver's
    # threads: only the bounds are properties.)
    assert phases["checking"] > 0 and 0 < phases["first_bucket"] <= echoed["seconds"]
    accounted = sum(value for key, value in phases.items() if key != "first_bucket")
    assert 0 < accounted <= echoed["seconds"] * 1.01

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


def start_receiving(live, **options):
    """A receiver of `live` whose receive() runs on a thread; its report or error lands in `outcome`."""
    receiver = weightstream.UpdateReceiver(live, transport="tcp", token="s3cret", timeout=30.0)
    outcome = {}

    def receive():
        try:
            outcome["report"] = receiver.receive(accept_timeout=60.0)
        except weightstream.Error as error:
            outcome["error"] = str(error)

    thread = threading.Thread(target=receive)
    thread.start()
    return receiver, thread, outcome


@pytest.mark.parametrize("shape", ["dict", "pairs", "iterator"])
def test_update_declares_and_sends_a_dict_pairs_or_an_iterator(tmp_path, shape):
    new = synth(tmp_path / "new", 2)
    live = cold_layout(synth(tmp_path / "old", 1))
    # Arrays of BF16 weightstream handed out carry their dtype: no dtype= needed.
    tensors = dict(new.stream(framework="numpy")) if shape == "dict" else list(new.stream(framework="numpy"))
    if shape == "iterator":
        tensors = iter(tensors)
    receiver, thread, outcome = start_receiving(live)
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", token="s3cret", bucket_bytes=1 << 20)
    report = sender.update(tensors)
    thread.join(timeout=60)
    assert outcome["report"]["tensors"] == report["tensors"] == len(new.names)
    assert parameter_bytes(live) == parameter_bytes(cold_layout(new))
    # The sender's own time, phase by phase, beside the receiver's phases.
    assert set(report["sender_phases"]) == {"describing", "starting", "sending", "finishing"}
    assert all(seconds >= 0 for seconds in report["sender_phases"].values())


def test_an_unknown_tensor_last_in_an_update_is_refused_before_any_byte(tmp_path):
    old = synth(tmp_path / "old", 1)
    new = synth(tmp_path / "new", 2)
    live = cold_layout(old)
    before = parameter_bytes(live)
    tensors = list(new.stream(framework="numpy")) + [("model.layers.1.mlp.extra.weight", np.zeros((4, 4), np.float32))]
    receiver, thread, outcome = start_receiving(live)
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", token="s3cret", bucket_bytes=1 << 20)
    with pytest.raises(weightstream.Error) as refused:
        sender.update(tensors)
    thread.join(timeout=60)
    assert f"refused the update: the update's manifest of {len(tensors)} tensors does not fit llama tp 1 rank 0 " \
        f"(1 problem; nothing of it was applied): tensor model.layers.1.mlp.extra.weight matches no parameter" \
        in str(refused.value)
    assert refused.value.code == "model"
    assert "failed before any bucket arrived" in outcome["error"]
    assert parameter_bytes(live) == before


def test_the_manifest_is_declared_with_start_and_binds_every_send(tmp_path):
    new = synth(tmp_path / "new", 2)
    live = cold_layout(synth(tmp_path / "old", 1))
    receiver, thread, outcome = start_receiving(live)
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", token="s3cret", bucket_bytes=1 << 20)
    with pytest.raises(weightstream.Error, match="update manifest: tensor 'model.norm.weight' has dtype 'Q7', neither "
                                                 r"a safetensors dtype name \(BF16, F8_E4M3, ...\) nor a torch dtype"):
        sender.start("checkpoint", [("model.norm.weight", "Q7", [64])])
    with pytest.raises(weightstream.Error, match=r"update manifest: each entry is \(name, dtype, shape\), got 2 fields"):
        sender.start("checkpoint", [("model.norm.weight", "BF16")])
    tensors = dict(new.stream(framework="numpy"))
    # Safetensors names and torch dtype names alike.
    sender.start("checkpoint", [(name, "torch.bfloat16" if i % 2 and new.dtypes[name] == "BF16" else new.dtypes[name],
                                 new.shapes[name]) for i, name in enumerate(tensors)])
    with pytest.raises(weightstream.Error, match="update sender: tensor lm_head.extra is not in the update's manifest"):
        sender.send("lm_head.extra", np.zeros(4, np.float32))
    name = next(iter(tensors))
    with pytest.raises(weightstream.Error, match=f"update sender: tensor {name} is F32 .* but the manifest declares it "
                                                 f"{new.dtypes[name]}"):
        sender.send(name, np.zeros(new.shapes[name], np.float32))
    for name, tensor in tensors.items():
        sender.send(name, tensor)
    sender.finish()
    thread.join(timeout=60)
    assert "report" in outcome and parameter_bytes(live) == parameter_bytes(cold_layout(new))


def test_a_receiver_refusal_reaches_the_sender_with_its_reason(tmp_path):
    new = synth(tmp_path / "new", 2)
    live = cold_layout(synth(tmp_path / "old", 1))
    before = parameter_bytes(live)
    receiver = weightstream.UpdateReceiver(live, transport="tcp", token="s3cret", timeout=30.0)
    errors = []

    def refuse():
        try:
            receiver.refuse("the engine replaced model.norm.weight", accept_timeout=60.0)
        except weightstream.Error as error:
            errors.append(error)

    thread = threading.Thread(target=refuse)
    thread.start()
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", token="s3cret")
    with pytest.raises(weightstream.Error) as refused:
        sender.update(dict(new.stream(framework="numpy")))
    thread.join(timeout=60)
    assert str(refused.value) == f"update receiver at {receiver.address} refused the update: " \
        "the engine replaced model.norm.weight"
    assert errors and errors[0].code == "model" and "the engine replaced model.norm.weight" in str(errors[0])
    assert parameter_bytes(live) == before


def test_torch_tensors_are_sent_as_they_are_read_from_their_attributes(tmp_path):
    """torch tensors (a Parameter too) cross without __dlpack__: the bytes that land are the
    tensors' own, a view that is not contiguous is still refused with its error, and uint8
    bytes keep the DLPack path."""
    torch = pytest.importorskip("torch")
    new = synth(tmp_path / "new", 2)
    live = cold_layout(synth(tmp_path / "old", 1))
    tensors = {name: torch.from_dlpack(np.ascontiguousarray(array)).view(torch.bfloat16).reshape(new.shapes[name])
               if new.dtypes[name] == "BF16" else torch.from_dlpack(np.ascontiguousarray(array))
               for name, array in new.stream(framework="numpy")}
    first = next(iter(tensors))
    tensors[first] = torch.nn.Parameter(tensors[first].clone(), requires_grad=True)
    receiver, thread, outcome = start_receiving(live)
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", token="s3cret", bucket_bytes=1 << 20)
    report = sender.update(tensors)
    thread.join(timeout=60)
    assert outcome["report"]["tensors"] == report["tensors"] == len(new.names)
    assert parameter_bytes(live) == parameter_bytes(cold_layout(new))

    name = next(n for n in new.names if len(new.shapes[n]) == 2 and new.dtypes[n] == "BF16")
    receiver, thread, outcome = start_receiving(live)
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", token="s3cret", bucket_bytes=1 << 20)
    sender.start("checkpoint", [(name, torch.bfloat16, new.shapes[name])])
    transposed = tensors[name].t().contiguous().t()  # its shape, column-major
    with pytest.raises(weightstream.Error, match=f"tensor '{name}' is not contiguous"):
        sender.send(name, transposed)
    with pytest.raises(weightstream.Error, match="has a dtype safetensors has no name for"):
        sender.send(name, torch.zeros(4, dtype=torch.complex64))
    receiver.cancel()
    thread.join(timeout=60)
