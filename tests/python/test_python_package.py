"""Tests of the installed weightstream Python package (python/, built by `pip install .`).

Every tensor streamed, loaded or digested is compared byte for byte with an independent
reading of the same files: the reference `safetensors` package where numpy has the dtype,
and a few lines of header parsing below where it has not (BF16). Checkpoints come from
`weightstream synth` (the CLI at $WS_CLI, default build/weightstream) with fixed seeds and
from the `safetensors` package's writer. The torch tests run where torch is importable.
"""

import gc
import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, parameter_bytes

np = pytest.importorskip("numpy")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
weightstream = pytest.importorskip("weightstream")

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
without_torch = pytest.mark.skipif(torch is not None, reason="checks the behaviour when torch is absent")


def test_imports_the_installed_package_not_the_source_tree():
    # The compiled core only exists in the installed package: a test that imported
    # python/weightstream from the checkout would fail here rather than pass by accident.
    assert (Path(weightstream.__file__).parent / "__init__.py").exists()
    assert hasattr(weightstream._core, "TensorStream")


# ---- an independent reader -----------------------------------------------------------------


def read_safetensors(path):
    """(name, dtype, shape, raw bytes) of every tensor of a file, in file order."""
    data = Path(path).read_bytes()
    (header_length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_length])
    header.pop("__metadata__", None)
    base = 8 + header_length
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    return [(name, e["dtype"], tuple(e["shape"]), data[base + e["data_offsets"][0] : base + e["data_offsets"][1]])
            for name, e in entries]


def shard_files(directory):
    """Shard files of a checkpoint directory in the order weightstream lists them."""
    index = Path(directory) / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [Path(directory) / name for name in names]
    return sorted(Path(directory).glob("*.safetensors"))


def reference_tensors(directory):
    tensors = []
    for shard in shard_files(directory):
        tensors.extend(read_safetensors(shard))
    return tensors


def tensor_bytes(tensor):
    """The raw bytes of whatever weightstream yielded (DLPack array or torch tensor)."""
    if torch is not None and isinstance(tensor, torch.Tensor):
        return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return np.from_dlpack(tensor).tobytes()


# ---- checkpoints ---------------------------------------------------------------------------


def synth(cli, directory, *args):
    result = subprocess.run([cli, "synth", str(directory), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return Path(directory)


@pytest.fixture(scope="module")
def synth_f32(cli, tmp_path_factory):
    return synth(cli, tmp_path_factory.mktemp("llama_f32"), "--arch", "llama", "--dtype", "f32", "--shards", "3", "--seed", "7")


@pytest.fixture(scope="module")
def synth_deepseek_f16(cli, tmp_path_factory):
    return synth(cli, tmp_path_factory.mktemp("deepseek_f16"), "--arch", "deepseek_v3", "--dtype", "f16", "--seed", "3")


@pytest.fixture(scope="module")
def synth_bf16(cli, tmp_path_factory):
    return synth(cli, tmp_path_factory.mktemp("qwen3_bf16"), "--arch", "qwen3", "--dtype", "bf16", "--seed", "11")


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    """A file from the safetensors package with every dtype numpy has, a scalar, empty
    tensors and odd shapes."""
    rng = np.random.default_rng(1234)
    tensors = {
        "bool": rng.integers(0, 2, (5, 3)).astype(np.bool_),
        "u8": rng.integers(0, 256, (7, 9), dtype=np.uint8),
        "i8": rng.integers(-128, 128, (33,), dtype=np.int8),
        "i16": rng.integers(-(2**15), 2**15, (4, 5, 6), dtype=np.int16),
        "u16": rng.integers(0, 2**16, (3, 1), dtype=np.uint16),
        "f16": rng.standard_normal((17, 3)).astype(np.float16),
        "i32": rng.integers(-(2**31), 2**31, (2, 2), dtype=np.int32),
        "u32": rng.integers(0, 2**32, (5,), dtype=np.uint32),
        "f32": rng.standard_normal((64, 129)).astype(np.float32),
        "f64": rng.standard_normal((3, 3, 3)).astype(np.float64),
        "i64": rng.integers(-(2**62), 2**62, (6,), dtype=np.int64),
        "u64": rng.integers(0, 2**63, (1, 4), dtype=np.uint64),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "large": rng.standard_normal((1024, 1024)).astype(np.float32),
    }
    path = tmp_path_factory.mktemp("mixed") / "mixed.safetensors"
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "np"})
    return path


def bf16_file(directory):
    """A file with BF16 and F8 tensors, written by hand (numpy has neither dtype)."""
    rng = np.random.default_rng(5)
    specs = {"w.bf16": ("BF16", (3, 4), 2), "w.f8": ("F8_E4M3", (8,), 1), "s.bf16": ("BF16", (), 2)}
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, itemsize) in specs.items():
        size = int(np.prod(shape, dtype=np.int64)) * itemsize
        blobs.append(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = Path(directory) / "raw.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


# ---- every byte, in order ------------------------------------------------------------------


def assert_stream_matches(uri, reference, **options):
    yielded = []
    for name, tensor in weightstream.stream(str(uri), **options):
        yielded.append((name, tensor_bytes(tensor)))
    assert [name for name, _ in yielded] == [name for name, *_ in reference], "file order and completeness"
    for (name, data), (_, _, _, expected) in zip(yielded, reference):
        assert data == expected, f"bytes of {name} differ"


def test_synth_checkpoints_match_safetensors_numpy(synth_f32, synth_deepseek_f16):
    for directory in (synth_f32, synth_deepseek_f16):
        expected = {}
        for shard in shard_files(directory):
            expected.update(safetensors_numpy.load_file(str(shard)))
        seen = []
        for name, tensor in weightstream.stream(str(directory), memory_limit="1MiB", concurrency=4):
            array = np.from_dlpack(tensor)
            reference = expected[name]
            assert array.dtype == reference.dtype and array.shape == reference.shape, name
            assert array.tobytes() == reference.tobytes(), f"{directory.name}: bytes of {name} differ"
            seen.append(name)
        assert sorted(seen) == sorted(expected), "every tensor exactly once"
        assert len(seen) == len(set(seen))


def test_iterator_yields_file_order_and_every_tensor(synth_f32):
    reference = reference_tensors(synth_f32)
    checkpoint = weightstream.open(str(synth_f32))
    assert checkpoint.names == [name for name, *_ in reference]
    assert len(checkpoint) == len(reference) and len(checkpoint.shards) == 3
    # Small limits make many batches and chunked reads; the order must not change.
    assert_stream_matches(synth_f32, reference, memory_limit="64KiB", chunk_size="4KiB", concurrency=8)
    assert_stream_matches(synth_f32, reference, concurrency=1)


def test_bf16_synth_checkpoint_streams_raw_or_as_torch(synth_bf16):
    reference = reference_tensors(synth_bf16)
    assert any(dtype == "BF16" for _, dtype, _, _ in reference)
    assert_stream_matches(synth_bf16, reference, memory_limit="256KiB")


def test_safetensors_package_file_every_numpy_dtype(mixed_file):
    expected = safetensors_numpy.load_file(str(mixed_file))
    checkpoint = weightstream.open(mixed_file)
    assert set(checkpoint.names) == set(expected)
    for name, tensor in checkpoint.stream(memory_limit="1MiB"):
        array = np.from_dlpack(tensor)
        assert array.dtype == expected[name].dtype, name
        assert array.shape == expected[name].shape, name
        assert array.tobytes() == expected[name].tobytes(), name
        # The buffer protocol gives the same memory without DLPack.
        assert np.asarray(tensor).tobytes() == expected[name].tobytes(), name
    for name, array in checkpoint.stream(framework="numpy"):
        assert isinstance(array, np.ndarray) and np.array_equal(array, expected[name]), name


def test_checkpoint_metadata(mixed_file, synth_f32):
    checkpoint = weightstream.open(mixed_file)
    reference = {name: (dtype, shape, len(data)) for name, dtype, shape, data in read_safetensors(mixed_file)}
    assert checkpoint.dtypes == {name: dtype for name, (dtype, _, _) in reference.items()}
    assert checkpoint.shapes == {name: shape for name, (_, shape, _) in reference.items()}
    assert {info.name: info.bytes for info in checkpoint.tensors} == {n: size for n, (_, _, size) in reference.items()}
    assert checkpoint.nbytes == sum(size for _, _, size in reference.values())
    assert checkpoint.shards == [("mixed.safetensors", mixed_file.stat().st_size)]
    assert "f32" in checkpoint and "nope" not in checkpoint
    assert checkpoint["f32"].shape == (64, 129) and checkpoint["f32"].dtype == "F32"
    with pytest.raises(KeyError, match="nope"):
        checkpoint["nope"]
    assert checkpoint.config is None
    synth_checkpoint = weightstream.open(synth_f32)
    assert synth_checkpoint.config["model_type"] == "llama"
    assert [name for name, _ in synth_checkpoint.shards] == [p.name for p in shard_files(synth_f32)]


def test_load_returns_every_tensor_from_one_arena(mixed_file):
    expected = safetensors_numpy.load_file(str(mixed_file))
    loaded = weightstream.load(str(mixed_file))
    assert list(loaded) == weightstream.open(mixed_file).names
    for name, tensor in loaded.items():
        assert np.from_dlpack(tensor).tobytes() == expected[name].tobytes(), name
    # One tensor keeps the arena alive after the dict and every other tensor are gone.
    view = np.from_dlpack(loaded["large"])
    del loaded
    gc.collect()
    assert view.tobytes() == expected["large"].tobytes()


def test_digest_matches_hashlib(mixed_file):
    digests = weightstream.digest(str(mixed_file))
    assert digests == {name: hashlib.sha256(data).hexdigest() for name, _, _, data in read_safetensors(mixed_file)}
    assert list(digests) == weightstream.open(mixed_file).names
    assert all(len(value) == 16 for value in weightstream.digest(str(mixed_file), hash="xxh64").values())
    with pytest.raises(weightstream.Error, match="unknown hash 'md5'"):
        weightstream.digest(str(mixed_file), hash="md5")


# ---- dtypes numpy lacks ----------------------------------------------------------------------


@without_torch
def test_raw_dtypes_come_as_uint8_with_an_itemsize_axis(tmp_path):
    path = bf16_file(tmp_path)
    reference = {name: (shape, data) for name, _, shape, data in read_safetensors(path)}
    for name, tensor in weightstream.stream(str(path)):
        array = np.from_dlpack(tensor)
        shape, data = reference[name]
        itemsize = 1 if name == "w.f8" else 2
        assert array.dtype == np.uint8 and array.shape == (*shape, itemsize), name
        assert array.tobytes() == data, name
    with pytest.raises(ImportError, match="PyTorch"):
        weightstream.stream(str(path), framework="torch")


@needs_torch
def test_raw_dtypes_come_as_torch_dtypes(tmp_path):
    path = bf16_file(tmp_path)
    reference = {name: (shape, data) for name, _, shape, data in read_safetensors(path)}
    expected_dtypes = {"w.bf16": torch.bfloat16, "s.bf16": torch.bfloat16, "w.f8": getattr(torch, "float8_e4m3fn", None)}
    for name, tensor in weightstream.stream(str(path)):
        shape, data = reference[name]
        if expected_dtypes[name] is None:
            continue  # a torch without float8 keeps the raw bytes
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == expected_dtypes[name], name
        assert tuple(tensor.shape) == shape, name
        assert tensor_bytes(tensor) == data, name


# ---- torch ----------------------------------------------------------------------------------


@needs_torch
def test_torch_from_dlpack_and_framework_torch(mixed_file, synth_bf16):
    expected = safetensors_numpy.load_file(str(mixed_file))
    for name, tensor in weightstream.stream(str(mixed_file)):
        converted = torch.from_dlpack(tensor)
        assert converted.numpy().tobytes() == expected[name].tobytes(), name
    from safetensors.torch import load_file as torch_load_file

    reference = {}
    for shard in shard_files(synth_bf16):
        reference.update(torch_load_file(str(shard)))
    for name, tensor in weightstream.stream(str(synth_bf16), framework="torch"):
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name


@needs_torch
def test_safetensors_weights_iterator_matches_safetensors_torch(synth_bf16):
    from safetensors.torch import load_file as torch_load_file

    files = [str(path) for path in shard_files(synth_bf16)]
    reference = {}
    for path in files:
        reference.update(torch_load_file(path))
    names = []
    for name, tensor in weightstream.safetensors_weights_iterator(files, use_tqdm_on_load=False):
        assert isinstance(tensor, torch.Tensor) and torch.equal(tensor, reference[name]), name
        names.append(name)
    assert sorted(names) == sorted(reference)
    # A single URI works as well as the list of files.
    assert [n for n, _ in weightstream.safetensors_weights_iterator(str(synth_bf16))] == names


@needs_torch
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="no CUDA device")
def test_stream_and_load_to_cuda(synth_bf16):
    if not weightstream.cuda_compiled():
        pytest.skip("this build of weightstream has no CUDA support")
    reference = {name: data for name, _, _, data in reference_tensors(synth_bf16)}
    for name, tensor in weightstream.stream(str(synth_bf16), device="cuda:0", framework="torch", memory_limit="1MiB"):
        assert tensor.device.type == "cuda", name
        assert tensor_bytes(tensor) == reference[name], name
    # Every device path of the stream, every tensor held until the end: a tensor handed out
    # before all its pieces' copies landed would differ here.
    for path in ("staged", "mapped", "both"):
        held = list(weightstream.stream(str(synth_bf16), device="cuda:0", framework="torch", gpu_path=path,
                                        memory_limit="256KiB", chunk_size="64KiB"))
        assert sorted(name for name, _ in held) == sorted(reference), path
        for name, tensor in held:
            assert tensor_bytes(tensor) == reference[name], (path, name)
    for name, tensor in weightstream.load(str(synth_bf16), device="cuda:0", framework="torch").items():
        assert tensor.device.type == "cuda" and tensor_bytes(tensor) == reference[name], name


@without_torch
def test_safetensors_weights_iterator_needs_torch(synth_f32):
    with pytest.raises(ImportError, match="PyTorch"):
        next(weightstream.safetensors_weights_iterator([str(p) for p in shard_files(synth_f32)]))


# ---- options and errors ----------------------------------------------------------------------


def test_options_have_the_command_defaults_and_accept_sizes(monkeypatch):
    for variable in [v for v in os.environ if v.startswith("WEIGHTSTREAM_")]:
        monkeypatch.delenv(variable)
    assert weightstream.resolve_options() == {
        "concurrency": 16, "memory_limit": 1 << 30, "chunk_size": 16 << 20, "io": "auto", "gpu_path": "auto",
        "mapped_share": 0.4, "prefetchers": None}
    assert weightstream.resolve_options(prefetchers=0)["prefetchers"] == 0
    monkeypatch.setenv("WEIGHTSTREAM_PREFETCHERS", "2")
    assert weightstream.resolve_options()["prefetchers"] == 2
    monkeypatch.delenv("WEIGHTSTREAM_PREFETCHERS")
    resolved = weightstream.resolve_options(memory_limit="64MiB", chunk_size=1 << 20, concurrency=3, io="direct")
    assert resolved["memory_limit"] == 64 << 20 and resolved["chunk_size"] == 1 << 20
    assert resolved["concurrency"] == 3 and resolved["io"] == "direct"
    monkeypatch.setenv("WEIGHTSTREAM_MEMORY_LIMIT", "128MiB")
    assert weightstream.resolve_options()["memory_limit"] == 128 << 20
    assert weightstream.resolve_options(memory_limit="2MiB")["memory_limit"] == 2 << 20


def test_bad_options_raise_with_the_library_messages(mixed_file, monkeypatch):
    with pytest.raises(weightstream.Error, match=r"memory_limit='12XB': unknown unit 'XB'") as error:
        weightstream.stream(str(mixed_file), memory_limit="12XB")
    assert error.value.code == "invalid_argument" and isinstance(error.value, RuntimeError)
    with pytest.raises(weightstream.Error, match="memory_limit 100 bytes is too small: at least 4KiB"):
        weightstream.open(str(mixed_file), memory_limit=100)
    with pytest.raises(weightstream.Error, match="concurrency 0 is out of range"):
        weightstream.open(str(mixed_file), concurrency=0)
    with pytest.raises(weightstream.Error, match="io='splice': expected auto, pread, direct, uring or mmap"):
        weightstream.open(str(mixed_file), io="splice")
    with pytest.raises(weightstream.Error, match=r"mapped_share='1.5\d*': expected a fraction from 0 to 1"):
        weightstream.open(str(mixed_file), mapped_share=1.5)
    with pytest.raises(TypeError, match="mapped_share must be a number from 0 to 1"):
        weightstream.open(str(mixed_file), mapped_share="0.4")
    assert weightstream.resolve_options(gpu_path="both", mapped_share=0.25)["mapped_share"] == 0.25
    with pytest.raises(weightstream.Error, match="prefetchers 2000 is out of range: expected 0 to 1024"):
        weightstream.open(str(mixed_file), prefetchers=2000)
    with pytest.raises(TypeError, match="prefetchers must be an int"):
        weightstream.open(str(mixed_file), prefetchers="3")
    with pytest.raises(TypeError, match="unknown option 'memory'"):
        weightstream.open(str(mixed_file), memory="1GiB")
    with pytest.raises(TypeError, match="memory_limit must be an int"):
        weightstream.open(str(mixed_file), memory_limit=1.5)
    with pytest.raises(weightstream.Error, match="invalid device 'gpu'"):
        weightstream.stream(str(mixed_file), device="gpu")
    with pytest.raises(ValueError, match="framework"):
        weightstream.stream(str(mixed_file), framework="jax")
    monkeypatch.setenv("WEIGHTSTREAM_MEMORY_LIMIT", "lots")
    with pytest.raises(weightstream.Error, match="WEIGHTSTREAM_MEMORY_LIMIT") as error:
        weightstream.open(str(mixed_file))
    assert error.value.code == "config"


def test_missing_and_malformed_checkpoints(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(weightstream.Error, match=f"checkpoint '{missing}' does not exist") as error:
        weightstream.open(str(missing))
    assert error.value.code == "not_found"
    with pytest.raises(weightstream.Error) as error:
        list(weightstream.stream(str(missing)))
    assert error.value.code == "not_found"
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(weightstream.Error, match="broken.safetensors") as error:
        weightstream.open(str(broken))
    assert error.value.code == "format"
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(weightstream.Error, match=str(empty_dir)):
        weightstream.load(str(empty_dir))
    if torch is not None:
        with pytest.raises(weightstream.Error):
            next(weightstream.safetensors_weights_iterator([str(missing)]))


def test_error_during_the_stream_raises_in_the_iterator(tmp_path):
    rng = np.random.default_rng(9)
    tensors = {f"t{i:02d}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(16)}
    path = tmp_path / "shrinking.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    checkpoint = weightstream.open(str(path))
    # The file loses its tail after the header was read: the reads of the last tensors fail.
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size - 100_000)
    yielded = []
    with pytest.raises(weightstream.Error, match="shrinking.safetensors") as error:
        for name, _ in checkpoint.stream(memory_limit="256KiB", concurrency=2):
            yielded.append(name)
    assert error.value.code in ("io", "format", "not_found"), error.value.code
    assert len(yielded) < len(tensors)


# ---- bounded memory and cancellation ---------------------------------------------------------


@pytest.fixture(scope="module")
def synth_256mib(cli, tmp_path_factory):
    return synth(cli, tmp_path_factory.mktemp("llama_256mib"), "--arch", "llama", "--size", "256MiB", "--seed", "1")


MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, weightstream

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

    checkpoint = weightstream.open(sys.argv[1])
    baseline = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    tensors = total = 0
    stream = checkpoint.stream(memory_limit=sys.argv[2], framework=sys.argv[3] if len(sys.argv) > 3 else None)
    for name, tensor in stream:
        total += memoryview(tensor).nbytes  # touch the bytes as a consumer would
        tensors += 1
        del tensor
    largest = max(info.bytes for info in checkpoint.tensors)
    print(json.dumps({"tensors": tensors, "bytes": total, "checkpoint": checkpoint.nbytes, "largest": largest,
                      "growth": status("VmHWM:") - baseline, "peak_queued": stream.peak_queued_bytes}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_stream_memory_stays_bounded_below_the_checkpoint_size(synth_256mib):
    limit = 32 << 20
    # framework="numpy": raw bytes for BF16, so the probe measures weightstream, not torch's import.
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(synth_256mib), str(limit), "numpy"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["checkpoint"] > 250 << 20
    assert report["bytes"] == report["checkpoint"] and report["tensors"] == len(weightstream.open(synth_256mib))
    assert report["peak_queued"] <= max(limit, report["largest"])
    # The promise is at most max(limit, largest tensor) of tensors in flight; allow the
    # allocator and the interpreter some slack, and still stay far below the checkpoint.
    assert report["growth"] < 2 * limit + report["largest"] + (16 << 20), report
    assert report["growth"] < report["checkpoint"] / 3, report


SLOW_CONSUMER_DEVICES = ["cpu"] + (["cuda:0"] if torch is not None and torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", SLOW_CONSUMER_DEVICES)
def test_a_slow_consumer_holds_the_readers_back_and_gets_every_byte(synth_bf16, device):
    # The stream is one read of the whole checkpoint: with a consumer slower than the
    # readers, readers wait for room (admission) while holding staging or a registered
    # window, which must never stop the tensors the consumer waits for from landing.
    if device != "cpu" and not weightstream.cuda_compiled():
        pytest.skip("this build of weightstream has no CUDA support")
    reference = {name: data for name, _, _, data in reference_tensors(synth_bf16)}
    largest = max(len(data) for data in reference.values())
    limit = 256 << 10
    paths = ("auto", "staged", "mapped", "both") if device != "cpu" else ("auto",)
    for path in paths:
        stream = weightstream.stream(str(synth_bf16), device=device, framework="torch" if device != "cpu" else None,
                                     gpu_path=path, memory_limit=limit, chunk_size="64KiB", concurrency=8)
        names = []
        for index, (name, tensor) in enumerate(stream):
            if index % 16 == 0:
                time.sleep(0.02)  # the readers run ahead until the queue is full
            assert tensor_bytes(tensor) == reference[name], (path, name)
            assert stream.queued_bytes <= max(limit, largest), (path, name)
            names.append(name)
        assert names == [name for name, _, _, _ in reference_tensors(synth_bf16)], path
        assert 0 < stream.peak_queued_bytes <= max(limit, largest), path


def task_count():
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_abandoning_the_iterator_stops_the_stream(synth_256mib):
    threads_before = task_count()
    for _ in range(3):
        start = time.monotonic()
        stream = weightstream.stream(str(synth_256mib), memory_limit="8MiB", framework="numpy")
        name, tensor = next(stream)
        assert name == weightstream.open(synth_256mib).names[0]
        assert stream.queued_bytes <= 8 << 20 or stream.queued_bytes <= max(i.bytes for i in stream.checkpoint.tensors)
        del stream  # dropped mid-stream: readers stop, the thread is joined
        gc.collect()
        assert time.monotonic() - start < 10
        # A tensor taken before the stream was dropped stays valid.
        assert len(memoryview(tensor).tobytes()) == weightstream.open(synth_256mib).tensors[0].bytes
    assert task_count() <= threads_before

    with weightstream.stream(str(synth_256mib), memory_limit="8MiB") as stream:
        for index, _ in enumerate(stream):
            if index == 10:
                break
    assert list(stream) == [], "a closed iterator is exhausted"
    assert task_count() <= threads_before

    def partial():
        for index, _ in enumerate(weightstream.stream(str(synth_256mib), memory_limit="8MiB")):
            if index == 5:
                return index

    assert partial() == 5
    gc.collect()
    assert task_count() <= threads_before


# ---- LoadSession --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synth_llama_bf16(cli, tmp_path_factory):
    return synth(cli, tmp_path_factory.mktemp("llama_bf16"), "--arch", "llama", "--dtype", "bf16", "--seed", "2")


def test_load_session_from_streamed_batches_equals_a_checkpoint_load(synth_llama_bf16):
    checkpoint = weightstream.open(str(synth_llama_bf16))
    reference = weightstream.model_layout(checkpoint, device="cpu")
    session = weightstream.LoadSession(reference)
    session.begin("cold")
    stats = session.load_checkpoint(checkpoint)
    session.finish()
    assert stats["tensors"] == len(checkpoint) and session.counters["tensors_applied"] == len(checkpoint)
    assert session.mode == "cold" and session.counters["model_hook_runs"] == 0
    # Where the readers' time went, as `load --json` reports it: some in reads, none negative.
    assert stats["read_seconds"] > 0 and stats["deliver_seconds"] >= 0 and stats["staging_wait_seconds"] >= 0

    layout = weightstream.model_layout(checkpoint, device="cpu")
    hook_runs = []
    layout.add_hook("count", lambda: hook_runs.append(layout.loads_finished))
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    # Small batches of what stream() yields; raw BF16 bytes need their dtype named.
    batch = []
    for name, tensor in checkpoint.stream(framework="numpy", memory_limit="1MiB"):
        batch.append((name, tensor, checkpoint.dtypes[name]))
        if len(batch) == 3:
            session.load(batch)
            batch = []
    session.load(batch)
    assert hook_runs == [], "the model hook never runs during load()"
    session.finish()
    assert hook_runs == [0] and session.counters["model_hook_runs"] == 1
    assert session.counters["parameters_completed"] == len(layout.parameter_names)
    assert parameter_bytes(layout) == parameter_bytes(reference)

    # A reload that leaves everything out keeps every value and runs the hook once more.
    before = parameter_bytes(layout)
    session.begin("reload")
    session.finish()
    assert hook_runs == [0, 1] and parameter_bytes(layout) == before


def test_load_session_errors_name_the_tensor_and_the_parameter(synth_llama_bf16):
    checkpoint = weightstream.open(str(synth_llama_bf16))
    layout = weightstream.model_layout(checkpoint, device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    wrong = np.zeros((3, 3), dtype=np.float32)
    with pytest.raises(weightstream.Error, match=r"model.layers.0.self_attn.q_proj.weight.*shape \[3, 3\]") as error:
        session.load([("model.layers.0.self_attn.q_proj.weight", wrong)])
    assert error.value.code == "model"
    # A session whose batch failed refuses to finish, with the first error.
    with pytest.raises(weightstream.Error, match=r"cannot finish the cold load of .*a batch failed \(tensor "
                                                 r"model.layers.0.self_attn.q_proj.weight has shape \[3, 3\].*"
                                                 r"nothing of that batch was written") as error:
        session.finish()
    session.begin("cold")
    with pytest.raises(weightstream.Error, match="missing"):
        session.finish()
    session.begin("cold")
    with pytest.raises(weightstream.Error, match="commit 'sometimes' is not one of arrival"):
        session.begin("reload", commit="sometimes")
    with pytest.raises(weightstream.Error, match="not contiguous"):
        session.load([("model.norm.weight", np.zeros((4, 4), dtype=np.float32).T)])
    with pytest.raises(weightstream.Error, match="load mode 'warm'"):
        session.begin("warm")

    def failing_hook():
        raise RuntimeError("derived buffer exploded")

    layout = weightstream.model_layout(checkpoint, device="cpu")
    layout.add_hook("failing", failing_hook)
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    with pytest.raises(weightstream.Error, match="model hook 'failing' raised RuntimeError: derived buffer exploded"):
        session.finish()


def test_modules_all_is_the_target_and_the_draft_as_two_layouts(synth_deepseek_f16):
    # Issue 18: the target holds layers 0 to num_hidden_layers - 1, the draft the MTP layers.
    checkpoint = weightstream.open(str(synth_deepseek_f16))
    target, draft = weightstream.model_layout(checkpoint, modules="all", device="cpu")
    layers = json.loads(checkpoint._core.config_json)["num_hidden_layers"]
    mtp = f"model.layers.{layers}."
    assert not [name for name in target.parameter_names if name.startswith(mtp)]
    assert draft.parameter_names and all(name.startswith(mtp) for name in draft.parameter_names)
    assert sorted(weightstream.model_layout(checkpoint).parameter_names) == sorted(target.parameter_names)
    with pytest.raises(weightstream.Error, match="modules 'both' is not one of target, draft"):
        weightstream.model_layout(checkpoint, modules="both")
