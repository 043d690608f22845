#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_update_message (the update protocol's frames, see
src/transfer/wire.hpp) into fuzz/corpus/fuzz_update_message/: one valid frame of each
message type and a few near misses. Deterministic. Usage: fuzz/make_update_corpus.py
"""

import struct
from pathlib import Path

OUT = Path(__file__).resolve().parent / "corpus" / "fuzz_update_message"
MAGIC = 0x50555357


def frame(kind, body, version=7, length=None):
    return struct.pack("<IHHQ", MAGIC, version, kind, len(body) if length is None else length) + body


def string(text):
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def entry(name, dtype, shape, tensor_offset, source_offset, size, source=0):
    return (string(name) + struct.pack("<BB", dtype, len(shape)) + b"".join(struct.pack("<q", d) for d in shape)
            + struct.pack("<QIQQ", tensor_offset, source, source_offset, size))


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
    "start_engine": frame(4, b"\x01" + struct.pack("<I", 0)),
    "start_manifest": frame(4, b"\x00" + struct.pack("<I", 3)
                            + declared("model.layers.0.mlp.down_proj.weight", F8_E4M3, [256, 256])
                            + declared("model.layers.0.mlp.down_proj.weight_scale_inv", F32, [2, 2])
                            + declared("model.norm.weight", BF16, [128])),
    "start_count_overflow": frame(4, b"\x00" + struct.pack("<I", 0xFFFFFFFF)),
    "accepted": frame(10, b""),
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
    "finish": frame(7, struct.pack("<Q", 4)),
    "report": frame(8, struct.pack("<QQQQQQdd", 4, 10, 1 << 20, 1 << 30, 0, 1, 0.5, 0.01)
                    + struct.pack("<9d", 0.001, 0.01, 0.1, 0.02, 0.001, 0.2, 0.15, 0.01, 0.001)
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
