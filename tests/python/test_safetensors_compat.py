"""Cross-checks weightstream against the reference `safetensors` package.

Checkpoints written by the reference writer must digest, tensor by tensor, to the SHA-256
of their raw row-major bytes; checkpoints written by `weightstream synth` must open in the
reference reader with the same names, shapes and bytes.

The CLI is the `cli` fixture of conftest.py ($WS_CLI, default build/weightstream).
"""

import hashlib
import json
import subprocess

import pytest

np = pytest.importorskip("numpy")
safetensors = pytest.importorskip("safetensors")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def run(cli, *args):
    result = subprocess.run([cli, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed ({result.returncode}): {result.stderr}"
    return result.stdout


def digest(cli, path, hash_name="sha256"):
    """Name -> hex digest from `weightstream digest --json` (one JSON object per line)."""
    out = run(cli, "digest", path, "--hash", hash_name, "--json", "--no-progress")
    digests = {}
    for line in out.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "content_digest" in record:  # the last line: the checkpoint's content digest
            continue
        assert record["name"] not in digests, f"tensor {record['name']} digested twice"
        digests[record["name"]] = record[hash_name]
    return digests


def sha256(data):
    return hashlib.sha256(bytes(data)).hexdigest()


def sample_tensors(seed):
    """A tensor of every dtype numpy can save, in shapes that include a scalar and an empty tensor."""
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((32, 32)).astype(np.float16),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((32, 48)).astype(np.float64),
        "model.layers.0.mlp.gate.e_score_correction_bias": rng.standard_normal(8).astype(np.float32),
        "counts.i8": rng.integers(-128, 127, (5, 7), dtype=np.int8),
        "counts.u8": rng.integers(0, 255, (3, 3, 3), dtype=np.uint8),
        "counts.i16": rng.integers(-1000, 1000, (11,), dtype=np.int16),
        "counts.i32": rng.integers(-(2**31), 2**31 - 1, (4, 4), dtype=np.int32),
        "counts.i64": rng.integers(-(2**62), 2**62, (6,), dtype=np.int64),
        "counts.u64": rng.integers(0, 2**63, (2, 2), dtype=np.uint64),
        "mask": rng.integers(0, 2, (9,)).astype(np.bool_),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def save_bf16(path, name, bits):
    """Writes `bits` (raw bfloat16 values as uint16) as a BF16 tensor with the reference writer."""
    if ml_dtypes is not None:
        safetensors_numpy.save_file({name: bits.view(ml_dtypes.bfloat16)}, str(path))
    elif hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8 takes specs of raw memory
        spec = safetensors.TensorSpec(
            dtype="bfloat16", shape=list(bits.shape), data_ptr=bits.ctypes.data, data_len=bits.nbytes
        )
        safetensors.serialize_file({name: spec}, str(path), metadata=None)
    else:  # older releases take dicts of bytes
        spec = {"dtype": "bfloat16", "shape": list(bits.shape), "data": bits.tobytes()}
        safetensors.serialize_file({name: spec}, str(path), metadata=None)


def test_reference_single_file_digests_match(cli, tmp_path):
    tensors = sample_tensors(1)
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    got = digest(cli, path)
    assert got == {name: sha256(np.ascontiguousarray(a).tobytes()) for name, a in tensors.items()}


def test_reference_bf16_digests_match(cli, tmp_path):
    bits = np.random.default_rng(2).integers(0, 2**16, (16, 24), dtype=np.uint16)
    path = tmp_path / "bf16.safetensors"
    save_bf16(path, "w.bf16", bits)
    with safetensors.safe_open(str(path), "np") as f:
        assert f.get_slice("w.bf16").get_dtype() == "BF16"
    assert digest(cli, path) == {"w.bf16": sha256(bits.tobytes())}


def test_reference_sharded_checkpoint_with_index(cli, tmp_path):
    tensors = sample_tensors(3)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for shard, members in shards.items():
        safetensors_numpy.save_file({n: tensors[n] for n in members}, str(tmp_path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in members})
    total = sum(tensors[n].nbytes for n in names)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    got = digest(cli, tmp_path)
    assert got == {name: sha256(tensors[name].tobytes()) for name in names}


def test_reference_xxh64_digest_covers_every_tensor(cli, tmp_path):
    tensors = sample_tensors(4)
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    got = digest(cli, path, "xxh64")
    assert set(got) == set(tensors)
    assert all(len(value) == 16 for value in got.values())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_synth_checkpoint_reads_in_the_reference(cli, tmp_path, arch):
    # F16 so that numpy, without ml_dtypes, can load every tensor (the DeepSeek router bias is F32).
    run(cli, "synth", tmp_path, "--arch", arch, "--seed", "7", "--shards", "3", "--dtype", "f16")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == arch

    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safetensors.safe_open(str(tmp_path / shard), "np") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == shard
                loaded[name] = f.get_tensor(name)
    assert set(loaded) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in loaded.values())

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert loaded["model.embed_tokens.weight"].shape == (vocab, hidden)
    assert loaded["model.norm.weight"].shape == (hidden,)
    for name, array in loaded.items():
        assert np.all(np.isfinite(array.astype(np.float32))), name
    if arch == "deepseek_v3":
        layer = config["num_hidden_layers"] - 1
        assert loaded[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].dtype == np.float32
        assert f"model.layers.{config['num_hidden_layers']}.eh_proj.weight" in loaded

    assert digest(cli, tmp_path) == {name: sha256(array.tobytes()) for name, array in loaded.items()}


def test_synth_bf16_opens_in_the_reference(cli, tmp_path):
    run(cli, "synth", tmp_path, "--arch", "llama", "--seed", "1", "--shards", "2")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    seen = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safetensors.safe_open(str(tmp_path / shard), "np") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                assert tensor.get_dtype() == "BF16"
                seen[name] = tuple(tensor.get_shape())
    assert set(seen) == set(index["weight_map"])
    assert seen["model.layers.0.self_attn.q_proj.weight"] == (256, 256)
