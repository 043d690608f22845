"""Host loads at the default io ("auto") and with io="mmap": tensors are copy-on-write views of a private mapping of their
shard (seen in /proc/self/maps), equal to what the `safetensors` package reads; misaligned
tensors load through the arena; writes reach neither the file nor another load; the mapping
lives while any tensor of the load does; a shard whose size changed since the checkpoint was
opened is refused by name. io="pread" copies every tensor.
"""

import gc
import hashlib
import json
import os
import struct
import subprocess

import pytest

np = pytest.importorskip("numpy")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
weightstream = pytest.importorskip("weightstream")


def mappings_of(path):
    """(begin, end, permissions) of every range of this process mapped from `path`."""
    wanted = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == wanted:
                begin, end = (int(value, 16) for value in fields[0].split("-"))
                ranges.append((begin, end, fields[1]))
    return ranges


def mapping_holding(path, array):
    """The permissions of the mapping of `path` that holds `array`'s bytes, or None."""
    begin = array.__array_interface__["data"][0]
    for low, high, permissions in mappings_of(path):
        if low <= begin and begin + max(array.nbytes, 1) <= high:
            return permissions
    return None


def privately_writable(permissions):
    return permissions is not None and permissions.startswith("rw") and permissions.endswith("p")


def sha256(path):
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


@pytest.fixture
def checkpoint(tmp_path):
    """Two shards written by the safetensors package; returns (directory, {name: shard path})."""
    rng = np.random.default_rng(19)
    shards = {
        "model-00001-of-00002.safetensors": {
            "embed": rng.standard_normal((64, 32)).astype(np.float32),
            "norm": rng.standard_normal(32).astype(np.float16),
            "ids": rng.integers(-(2**40), 2**40, size=(7,), dtype=np.int64),
        },
        "model-00002-of-00002.safetensors": {
            "head": rng.standard_normal((32, 16)).astype(np.float64),
            "mask": rng.integers(0, 255, size=(5, 3), dtype=np.uint8),
            "bias": rng.standard_normal(16).astype(np.float32),
        },
    }
    where = {}
    for file, tensors in shards.items():
        safetensors_numpy.save_file(tensors, str(tmp_path / file))
        where.update({name: str(tmp_path / file) for name in tensors})
    return tmp_path, where


def reference(directory):
    tensors = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            tensors.update(safetensors_numpy.load_file(str(directory / file)))
    return tensors


def test_values_are_what_safetensors_reads(checkpoint):
    directory, _ = checkpoint
    expected = reference(directory)
    loaded = weightstream.load(str(directory), device="cpu", framework="numpy", io="mmap")
    assert sorted(loaded) == sorted(expected)
    for name, array in loaded.items():
        assert array.dtype == expected[name].dtype and array.shape == expected[name].shape, name
        assert np.array_equal(array, expected[name]), name


def test_tensors_are_private_views_of_their_shard_by_default_and_with_mmap_and_copies_with_pread(checkpoint):
    directory, where = checkpoint
    assert weightstream.resolve_options()["io"] == "auto"
    by_default = weightstream.load(str(directory), device="cpu", framework="numpy")
    mapped = weightstream.load(str(directory), device="cpu", framework="numpy", io="mmap")
    copied = weightstream.load(str(directory), device="cpu", framework="numpy", io="pread")
    for name in where:
        assert privately_writable(mapping_holding(where[name], by_default[name])), name
        assert privately_writable(mapping_holding(where[name], mapped[name])), name
        assert mapping_holding(where[name], copied[name]) is None, name
        assert np.array_equal(by_default[name], copied[name]), name


def test_writes_reach_neither_the_file_nor_another_load(checkpoint):
    directory, where = checkpoint
    expected = reference(directory)
    digests = {path: sha256(path) for path in set(where.values())}
    loaded = weightstream.load(str(directory), device="cpu", framework="numpy", io="mmap")
    for array in loaded.values():
        array[...] = 0
    assert {path: sha256(path) for path in digests} == digests
    again = weightstream.load(str(directory), device="cpu", framework="numpy", io="mmap")
    for name, array in again.items():
        assert not loaded[name].any(), name
        assert np.array_equal(array, expected[name]), name


def test_the_mapping_lives_while_any_tensor_does(checkpoint):
    directory, where = checkpoint
    expected = reference(directory)
    loaded = weightstream.load(str(directory), device="cpu", framework="numpy", io="mmap")
    kept = loaded["head"]
    del loaded
    gc.collect()
    assert privately_writable(mapping_holding(where["head"], kept))
    assert np.array_equal(kept, expected["head"])
    del kept
    gc.collect()
    for path in set(where.values()):
        assert not any(privately_writable(permissions) for _, _, permissions in mappings_of(path)), path


def write_misaligned(path):
    """A file the safetensors writer would not produce (it sorts by dtype, which keeps every
    tensor aligned): 3 bytes of U8, then an F32 and an I16 at odd offsets, then an aligned
    U8. The safetensors package reads it as the reference."""
    ones = np.arange(5, dtype=np.float32) * 1.5
    shorts = np.array([-3, 7], dtype=np.int16)
    body = bytes([1, 2, 3]) + ones.tobytes() + shorts.tobytes() + bytes([9])
    header = json.dumps({
        "small": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "odd": {"dtype": "F32", "shape": [5], "data_offsets": [3, 23]},
        "shorts": {"dtype": "I16", "shape": [2], "data_offsets": [23, 27]},
        "last": {"dtype": "U8", "shape": [1], "data_offsets": [27, 28]},
    }).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(header)) + header + body)


def test_misaligned_tensors_load_through_the_arena(tmp_path):
    path = str(tmp_path / "model.safetensors")
    write_misaligned(path)
    expected = safetensors_numpy.load_file(path)
    loaded = weightstream.load(path, device="cpu", framework="numpy", io="mmap")
    for name in expected:
        assert loaded[name].dtype == expected[name].dtype, name
        assert np.array_equal(loaded[name], expected[name]), name
    assert mapping_holding(path, loaded["odd"]) is None
    assert mapping_holding(path, loaded["shorts"]) is None
    assert privately_writable(mapping_holding(path, loaded["small"]))
    assert privately_writable(mapping_holding(path, loaded["last"]))


def test_a_shard_whose_size_changed_since_open_is_named(checkpoint):
    directory, where = checkpoint
    opened = weightstream.Checkpoint(str(directory))
    shard = where["head"]
    recorded = os.path.getsize(shard)
    os.truncate(shard, recorded - 16)
    with pytest.raises(weightstream.Error) as failure:
        opened.load(device="cpu", io="mmap")
    message = str(failure.value)
    assert failure.value.code == "io"
    assert shard in message and str(recorded) in message and str(recorded - 16) in message
    assert "changed since it was opened" in message


def test_the_cli_counts_the_whole_load(cli, checkpoint):
    directory, _ = checkpoint

    def load(*extra):
        out = subprocess.run([cli, "load", str(directory), "--json", "--no-progress", *extra], check=True,
                             capture_output=True, text=True, timeout=120).stdout
        return json.loads(out)

    mapped, by_default, copied = load("--io", "mmap"), load(), load("--io", "pread")
    assert mapped["tensors"] == copied["tensors"] == by_default["tensors"] == 6
    assert mapped["tensors_in_place"] == by_default["tensors_in_place"] == 6
    assert copied["tensors_in_place"] == 0
    assert by_default["bytes"] == by_default["bytes_read"] == mapped["bytes"]
    assert mapped["bytes"] == copied["bytes"] == weightstream.Checkpoint(str(directory)).nbytes
    assert mapped["shards_read"] == 2


def test_torch_tensors_of_a_default_host_load_are_the_views_safetensors_torch_gives(checkpoint):
    """At the default io, torch tensors are views of the same private mappings; a write into
    one reaches neither the file nor safetensors' own torch load of it afterwards."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    directory, where = checkpoint
    digests = {path: sha256(path) for path in set(where.values())}
    loaded = weightstream.load(str(directory), device="cpu", framework="torch")
    for name, tensor in loaded.items():
        expected = safetensors_torch.load_file(where[name])[name]
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
        assert privately_writable(mapping_holding(where[name], tensor.numpy())), name
        tensor.zero_()
    assert {path: sha256(path) for path in digests} == digests
    for name in loaded:
        assert not loaded[name].any(), name
        assert torch.equal(safetensors_torch.load_file(where[name])[name],
                           torch.from_numpy(reference(directory)[name])), name
