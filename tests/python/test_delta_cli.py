"""Issue 46: delta updates from the command line. `audit A --reload B --via T --delta` loads a
synthetic llama A, pushes B (A with a random 1% of its elements changed, and one tensor
rewritten whole) as a delta from a `send --delta-from A` process, and compares every parameter
with a cold load of B; a delta from another version than the one the receiver holds is refused
before its first byte, naming both content digests; and the flags that do not combine say so."""
import json
import os
import re
import shutil
import struct
import subprocess

import numpy
import pytest
from conftest import CLI, requires_cli

pytestmark = requires_cli

TOKEN = "delta-token-" + os.urandom(6).hex()
REWRITTEN = "model.norm.weight"  # every element changes: it goes whole


def run(arguments, stdin=""):
    return subprocess.run([CLI, *arguments], input=stdin, capture_output=True, text=True, timeout=300)


def change_elements(directory, fraction, seed):
    """Flips one bit of a random `fraction` of every tensor's elements (and of every element of
    REWRITTEN) in the shards of `directory`, in place."""
    random = numpy.random.default_rng(seed)
    for shard in sorted(directory.glob("*.safetensors")):
        data = bytearray(shard.read_bytes())
        (header_bytes,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + header_bytes])
        start = 8 + header_bytes
        for name, info in header.items():
            if name == "__metadata__":
                continue
            element = {"BF16": 2, "F16": 2, "F32": 4}.get(info["dtype"], 1)
            begin, end = info["data_offsets"]
            elements = (end - begin) // element
            count = elements if name == REWRITTEN else int(elements * fraction)
            picked = numpy.arange(elements) if name == REWRITTEN else random.choice(elements, count, replace=False)
            for index in picked:
                data[start + begin + int(index) * element] ^= 1
        shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta")
    a, b = root / "a", root / "b"
    subprocess.run([CLI, "synth", str(a), "--arch", "llama", "--layers", "2", "--seed", "46"], check=True,
                   capture_output=True)
    shutil.copytree(a, b)
    change_elements(b, 0.01, 46)
    return a, b


def content_digest(uri):
    result = run(["digest", str(uri), "--json", "--no-progress"])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])["content_digest"]


def checkpoint_bytes(directory):
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


@pytest.mark.parametrize("via", ["shm", "tcp", "ucx"])
def test_a_delta_lands_equal_to_a_cold_load_of_the_new_version(versions, via):
    a, b = versions
    result = run(["audit", str(a), "--reload", str(b), "--via", via, "--delta", "--json", "--no-progress"])
    if via == "ucx" and "not compiled into this build" in result.stderr:
        pytest.skip("this build has no UCX (WS_WITH_UCX)")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["clean"] and report["mismatched"] == 0 and report["address_changes"] == 0, report
    assert report["dense_tensors"] >= 1 and report["sparse_tensors"] > report["dense_tensors"], report
    assert report["checked_tensors"] == report["sparse_tensors"], report  # each checked after it landed
    # 1% of the elements changed: about 2% of the bytes move (positions and values).
    assert report["reload_bytes"] < checkpoint_bytes(b) // 10, report


def test_bf16_weights_go_to_an_fp8_model_as_the_changes_of_their_codes_and_scales(tmp_path):
    # The FP8 checkpoint is its BF16 weights quantized (the same seed, block-aligned sizes);
    # send --delta-from it quantizes the changed BF16 weights as the checkpoint does.
    fp8, bf16 = tmp_path / "fp8", tmp_path / "bf16"
    subprocess.run([CLI, "synth", str(fp8), "--arch", "llama", "--layers", "2", "--seed", "5", "--quantize",
                    "fp8-block"], check=True, capture_output=True)
    subprocess.run([CLI, "synth", str(bf16), "--arch", "llama", "--layers", "2", "--seed", "5", "--block-aligned"],
                   check=True, capture_output=True)
    change_elements(bf16, 0.01, 5)
    result = run(["audit", str(fp8), "--reload", str(bf16), "--via", "tcp", "--delta", "--json", "--no-progress"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["clean"] and report["mismatched"] == 0, report
    # Every linear weight's codes go as changes (14 in 2 llama layers); its small scales whole.
    assert report["sparse_tensors"] >= 14, report
    assert report["reload_bytes"] < checkpoint_bytes(fp8) // 10, report


def test_the_full_update_stays_the_default(versions):
    a, b = versions
    result = run(["audit", str(a), "--reload", str(b), "--via", "shm", "--json", "--no-progress"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["clean"] and "sparse_tensors" not in report
    assert report["reload_bytes"] > checkpoint_bytes(b) // 2


def test_a_delta_from_another_version_is_refused_naming_both_digests(versions):
    a, b = versions
    receiver = subprocess.Popen([CLI, "audit", str(a), "--reload", str(b), "--via", "tcp", "--delta", "--await-sender",
                                 "--token-stdin", "--no-progress"], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        receiver.stdin.write(TOKEN + "\n")
        receiver.stdin.close()
        address = None
        for line in receiver.stderr:
            found = re.search(r"awaiting a sender at (\S+)", line)
            if found:
                address = found.group(1)
                break
        assert address, "the receiver printed no address"
        # The receiver holds A; this delta applies to B.
        sent = run(["send", str(b), "--to", address, "--via", "tcp", "--delta-from", str(b), "--token-stdin",
                    "--no-progress"], TOKEN + "\n")
        expected = (f"the delta update applies to content digest {content_digest(b)} but this receiver holds "
                    f"{content_digest(a)}")
        assert sent.returncode != 0
        assert expected in sent.stderr, sent.stderr
        rest = receiver.stderr.read()
        assert receiver.wait(timeout=300) != 0
        assert expected in rest, rest
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


@pytest.mark.parametrize("flags, message", [
    (["--repeat", "2"], "--delta-from sends one update from the version the receivers hold; it does not combine "
                        "with --repeat"),
    (["--format", "engine"], "--delta-from sends checkpoint-format tensors; it does not combine with --format engine"),
])
def test_send_refuses_delta_flags_that_do_not_combine(versions, flags, message):
    a, b = versions
    result = run(["send", str(b), "--to", "127.0.0.1:9", "--delta-from", str(a), *flags, "--no-progress"])
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_audit_delta_needs_via_and_one_update(versions):
    a, b = versions
    result = run(["audit", str(a), "--reload", str(b), "--delta", "--no-progress"])
    assert result.returncode != 0 and "--delta requires --via" in result.stderr, result.stderr
    result = run(["audit", str(a), "--reload", str(b), "--via", "shm", "--delta", "--repeat", "2", "--no-progress"])
    assert result.returncode != 0
    assert "--delta pushes one update from the loaded version; it does not combine with --repeat" in result.stderr
