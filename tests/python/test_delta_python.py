"""Issue 46 from Python: UpdateReceiver.version and UpdateSender.start(..., base=, target=) with
send_changes(). A layout loaded from a synthetic llama A takes the delta to B (A with 1% of its
elements changed) equal to a cold load of B, in place; a delta for another version is refused
before its first byte, naming both digests, with the layout unchanged."""
import json
import shutil
import struct
import subprocess
import threading

import pytest
from conftest import CLI, requires_cli, cold_layout, parameter_bytes
from test_delta_cli import change_elements

weightstream = pytest.importorskip("weightstream")
pytest.importorskip("numpy")

pytestmark = requires_cli


def content_digest(directory):
    result = subprocess.run([CLI, "digest", str(directory), "--json", "--no-progress"], check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["content_digest"]


def manifest_of(directory):
    """(name, dtype, shape) of every tensor, from the shards' headers."""
    manifest = []
    for shard in sorted(directory.glob("*.safetensors")):
        data = shard.read_bytes()
        (header_bytes,) = struct.unpack("<Q", data[:8])
        for name, info in json.loads(data[8:8 + header_bytes]).items():
            if name != "__metadata__":
                manifest.append((name, info["dtype"], info["shape"]))
    return manifest


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta-python")
    a, b = root / "a", root / "b"
    subprocess.run([CLI, "synth", str(a), "--arch", "llama", "--layers", "2", "--hidden", "64", "--seed", "46"],
                   check=True, capture_output=True)
    shutil.copytree(a, b)
    change_elements(b, 0.01, 47)
    return a, b


def receive_in_thread(receiver):
    outcome = {}

    def receive():
        try:
            outcome["report"] = receiver.receive(accept_timeout=60.0)
        except weightstream.Error as error:
            outcome["error"] = str(error)

    thread = threading.Thread(target=receive)
    thread.start()
    return thread, outcome


def test_a_delta_from_python_lands_equal_to_a_cold_load(versions):
    a, b = versions
    live = cold_layout(str(a))
    expected = parameter_bytes(cold_layout(str(b)))
    assert parameter_bytes(live) != expected
    receiver = weightstream.UpdateReceiver(live, token="t", timeout=30.0)
    receiver.version = content_digest(a)
    thread, outcome = receive_in_thread(receiver)
    old = weightstream.load(str(a), framework="numpy")
    new = weightstream.load(str(b), framework="numpy")
    manifest = manifest_of(b)
    sender = weightstream.UpdateSender(receiver.address, token="t", bucket_bytes=1 << 20)
    sender.start("checkpoint", manifest, base=content_digest(a), target=content_digest(b))
    sparse = sum(sender.send_changes(name, old[name], new[name], dtype) for name, dtype, _ in manifest)
    report = sender.finish()
    thread.join(timeout=60)
    assert "error" not in outcome, outcome
    assert parameter_bytes(live) == expected
    assert sparse > 0 and report["sparse_tensors"] == sparse
    assert report["sparse_tensors"] + report["dense_tensors"] == len(manifest)
    assert receiver.version == content_digest(b)


def test_update_changes_sends_a_whole_delta_in_one_call(versions):
    a, b = versions
    live = cold_layout(str(a))
    expected = parameter_bytes(cold_layout(str(b)))
    receiver = weightstream.UpdateReceiver(live, token="t", timeout=30.0)
    receiver.version = content_digest(a)
    thread, outcome = receive_in_thread(receiver)
    old = weightstream.load(str(a), framework="numpy")
    new = weightstream.load(str(b), framework="numpy")
    # A tensor without its base goes whole (unchanged, it would go as an empty delta), beside
    # model.norm.weight, rewritten whole (test_delta_cli.REWRITTEN).
    del old["model.layers.0.input_layernorm.weight"]
    sender = weightstream.UpdateSender(receiver.address, token="t", bucket_bytes=1 << 20)
    report = sender.update_changes(old, new, base=content_digest(a), target=content_digest(b))
    thread.join(timeout=60)
    assert "error" not in outcome, outcome
    assert parameter_bytes(live) == expected
    assert report["dense_tensors"] == 2 and report["sparse_tensors"] == len(new) - 2
    assert receiver.version == content_digest(b)


def test_a_delta_for_another_version_is_refused_naming_both(versions):
    a, b = versions
    live = cold_layout(str(a))
    before = parameter_bytes(live)
    receiver = weightstream.UpdateReceiver(live, token="t", timeout=30.0)
    receiver.version = "0123456789abcdef"
    thread, outcome = receive_in_thread(receiver)
    sender = weightstream.UpdateSender(receiver.address, token="t", bucket_bytes=1 << 20)
    expected = f"the delta update applies to content digest {content_digest(a)} but this receiver holds 0123456789abcdef"
    with pytest.raises(weightstream.Error, match=expected):
        sender.start("checkpoint", manifest_of(b), base=content_digest(a), target=content_digest(b))
    thread.join(timeout=60)
    assert expected in outcome.get("error", ""), outcome
    assert parameter_bytes(live) == before
    assert receiver.version == "0123456789abcdef"


def test_update_changes_quantizes_bf16_weights_into_an_fp8_model_at_the_sender(tmp_path):
    # The FP8 checkpoint is its BF16 weights quantized (the same seed, block-aligned sizes).
    fp8, bf16 = tmp_path / "fp8", tmp_path / "bf16"
    subprocess.run([CLI, "synth", str(fp8), "--arch", "llama", "--layers", "2", "--seed", "5", "--quantize",
                    "fp8-block"], check=True, capture_output=True)
    subprocess.run([CLI, "synth", str(bf16), "--arch", "llama", "--layers", "2", "--seed", "5", "--block-aligned"],
                   check=True, capture_output=True)
    change_elements(bf16, 0.01, 6)
    live = cold_layout(str(fp8))
    expected_layout = weightstream.model_layout(weightstream.open(str(fp8)), device="cpu")
    session = weightstream.LoadSession(expected_layout)  # B's BF16 weights, quantized on receipt
    session.begin("cold")
    session.load_checkpoint(str(bf16))
    session.finish()
    receiver = weightstream.UpdateReceiver(live, token="t", timeout=30.0)
    receiver.version = content_digest(fp8)
    thread, outcome = receive_in_thread(receiver)
    sender = weightstream.UpdateSender(receiver.address, token="t", bucket_bytes=1 << 20)
    report = sender.update_changes(weightstream.load(str(fp8), framework="numpy"),
                                   weightstream.load(str(bf16), framework="numpy"), base=content_digest(fp8))
    thread.join(timeout=60)
    assert "error" not in outcome, outcome
    assert parameter_bytes(live) == parameter_bytes(expected_layout)
    assert report["sparse_tensors"] >= 14, report  # every linear weight's codes
    assert receiver.version == ""  # the update named no target


def test_a_delta_from_another_base_than_it_names_is_caught_after_it_lands_by_name(versions):
    """The trainer's copy of A already holds B's values of one tensor: it sends none of its
    changes, and the receiver's check after the delta names that tensor; its version is then
    unknown (the next update must be a full one)."""
    a, b = versions
    receiver = weightstream.UpdateReceiver(cold_layout(str(a)), token="t", timeout=30.0)
    receiver.version = content_digest(a)
    thread, outcome = receive_in_thread(receiver)
    old = weightstream.load(str(a), framework="numpy")
    new = weightstream.load(str(b), framework="numpy")
    drifted = "model.layers.1.mlp.down_proj.weight"
    old[drifted] = new[drifted]
    sender = weightstream.UpdateSender(receiver.address, token="t", bucket_bytes=1 << 20)
    with pytest.raises(weightstream.Error, match="differs from the version the sender named") as raised:
        sender.update_changes(old, new, base=content_digest(a), target=content_digest(b))
    thread.join(timeout=60)
    assert f"tensor {drifted} in {drifted} (its elements here hash to" in str(raised.value)
    assert f"tensor {drifted} in {drifted}" in outcome["error"]
    assert "send a full update" in outcome["error"]
    assert receiver.version == ""
