#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_update_message (the update protocol's frames, see
src/update/wire.hpp) into fuzz/corpus/fuzz_update_message/: one valid frame of each
message type and a few near misses; and that of fuzz_changed_elements (a delta's changed
elements, src/update/delta.hpp) into fuzz/corpus/fuzz_changed_elements/. Deterministic.
Usage: fuzz/make_update_corpus.py
"""

import struct
from pathlib import Path

OUT = Path(__file__).resolve().parent / "corpus" / "fuzz_update_message"
MAGIC = 0x50555357


def frame(kind, body, version=9, length=None):
    return struct.pack("<IHHQ", MAGIC, version, kind, len(body) if length is None else length) + body


def string(text):
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def entry(name, dtype, shape, tensor_offset, source_offset, size, source=0, encoding=0):
    return (string(name) + struct.pack("<BB", dtype, len(shape)) + b"".join(struct.pack("<q", d) for d in shape)
            + struct.pack("<QIQQB", tensor_offset, source, source_offset, size, encoding))


def start(format_code, count, base="", target=""):
    """START's fields before its declared tensors: format, delta flag, versions, count."""
    return struct.pack("<BB", format_code, 1 if base else 0) + string(base) + string(target) + struct.pack("<I", count)


def declared(name, dtype, shape):
    return string(name) + struct.pack("<BB", dtype, len(shape)) + b"".join(struct.pack("<q", d) for d in shape)


def region(region_id, size, handle=b"\xab" * 64):
    return struct.pack("<IQ", region_id, size) + struct.pack("<I", len(handle)) + handle


BF16 = 6
F8_E4M3 = 14
F32 = 9
SEEDS = {
    "hello": frame(1, struct.pack("<BQII", 2, 1 << 20, 2, 1) + string("")),
    "welcome": frame(2, struct.pack("<QI", 1 << 20, 2) + string("")),
    "refuse": frame(3, string("wrong or missing token")),
    "start_engine": frame(4, start(1, 0)),
    "start_manifest": frame(4, start(0, 3)
                            + declared("model.layers.0.mlp.down_proj.weight", F8_E4M3, [256, 256])
                            + declared("model.layers.0.mlp.down_proj.weight_scale_inv", F32, [2, 2])
                            + declared("model.norm.weight", BF16, [128])),
    "start_count_overflow": frame(4, start(0, 0xFFFFFFFF)),
    "start_delta": frame(4, start(0, 1, "a0a0a0a0a0a0a0a0", "b1b1b1b1b1b1b1b1")
                         + declared("model.norm.weight", BF16, [128])),
    "bucket_changes": frame(5, struct.pack("<QIQII", 0, 0, 40, 0, 1)
                            + entry("model.norm.weight", BF16, [128], 0, 0, 40, encoding=1)),
    "accepted": frame(10, struct.pack("<I", 0)),
    "accepted_windows": frame(10, struct.pack("<II", 2, 1) + struct.pack("<4Q", 0, 64, 0, 128) + struct.pack("<I", 0)),
    "bucket": frame(5, struct.pack("<QIQII", 0, 0, 8448, 0, 2)
                    + entry("model.layers.0.self_attn.q_proj.weight", BF16, [64, 64], 0, 0, 8192)
                    + entry("model.norm.weight", BF16, [128], 0, 8192, 256)),
    "bucket_piece": frame(5, struct.pack("<QIQII", 3, 1, 4096, 0, 1)
                          + entry("lm_head.weight", BF16, [1000, 256], 4096, 0, 4096)),
    "bucket_shared": frame(5, struct.pack("<QIQI", 1, 0, 256, 2) + region(0, 1 << 30) + region(1, 1 << 20)
                           + struct.pack("<I", 2)
                           + entry("model.layers.1.mlp.up_proj.weight", BF16, [64, 64], 0, 4096, 8192, source=1)
                           + entry("model.norm.weight", BF16, [128], 0, 0, 256)),
    "applied": frame(6, struct.pack("<QI", 3, 1)),
    "finish": frame(7, struct.pack("<QI", 4, 0)),
    "finish_digests": frame(7, struct.pack("<QI", 4, 2) + struct.pack("<IQ", 0, 0x1234) + struct.pack("<IQ", 5, 1)),
    "report": frame(8, struct.pack("<QQQQQQQQQdd", 4, 10, 1 << 20, 1 << 30, 0, 1, 7, 3, 7, 0.5, 0.01)
                    + struct.pack("<10d", 0.001, 0.01, 0.1, 0.02, 0.001, 0.2, 0.15, 0.01, 0.02, 0.001)
                    + struct.pack("<6Q", 10, 1 << 20, 0, 12, 0, 1)
                    + struct.pack("<I", 3) + struct.pack("<3q", -1, 0, 1)),
    "error": frame(9, struct.pack("<B", 8) + string("tensor x matches no parameter")),
    "bad_version": frame(4, b"\x00", version=1),
    "huge_length": frame(5, b"", length=1 << 40),
    "count_overflow": frame(5, struct.pack("<QIQII", 0, 0, 0, 0, 0xFFFFFFFF)),
}

OUT.mkdir(parents=True, exist_ok=True)
for name, data in SEEDS.items():
    (OUT / name).write_bytes(data)

# ---- fuzz_changed_elements (delta updates, src/update/delta.hpp): one byte picking the
# element size (0: 1 byte, 1: 2, 2: 4, 3: 8), the tensor's elements (u32), the encoding.
import ctypes  # noqa: E402 - the second corpus's own needs

XXH64 = ctypes.CDLL("libxxhash.so.0").XXH64
XXH64.restype = ctypes.c_uint64
XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
CHANGES_OUT = Path(__file__).resolve().parent / "corpus" / "fuzz_changed_elements"


def varint(value):
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def changes(indices, values, element_bytes):
    positions, previous = b"", 0
    for index in indices:
        positions += varint(index - previous)
        previous = index + 1
    body = struct.pack("<QQ", len(indices), len(positions)) + positions + values
    assert len(values) == len(indices) * element_bytes
    return body + struct.pack("<Q", XXH64(body, len(body), 0))


CHANGE_SEEDS = {
    "bf16_two": b"\x01" + struct.pack("<I", 12) + changes([1, 11], struct.pack("<HH", 20, 120), 2),
    "fp8_scattered": b"\x00" + struct.pack("<I", 4096)
                     + changes([3, 130, 131, 4000], bytes([0x38, 0x40, 0xC0, 0x7E]), 1),
    "f32_none": b"\x02" + struct.pack("<I", 64) + changes([], b"", 4),
    "bf16_past_the_end": b"\x01" + struct.pack("<I", 4) + changes([7], struct.pack("<H", 9), 2),
}
CHANGES_OUT.mkdir(parents=True, exist_ok=True)
for name, data in CHANGE_SEEDS.items():
    (CHANGES_OUT / name).write_bytes(data)
