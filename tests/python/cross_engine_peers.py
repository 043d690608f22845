"""One engine's side of pulls between an SGLang and a vLLM instance, for the SGLang stage
(tests/python/test_sglang_vllm_peers.py), run in that engine's own environment:

- ``serve ENGINE READY STOP PATH...``: the engine's model of each checkpoint PATH loaded by
  weightstream with extra-config ``serve`` (a free port each); their addresses, content
  digests and layouts written to READY (JSON, by PATH); they serve until the file STOP exists.
- ``pull ENGINE PLAN OUT``: for each pull of PLAN (JSON: config_folder, a folder of config.json
  only; uri, the peers; digest, pinned; checkpoint, the oracle's), the engine's model of
  config_folder loaded by weightstream from the peers, compared with the engine's default load
  of checkpoint; the results (or each error) written to OUT (JSON, in order).

ENGINE is "sglang" (SGLang's ModelRunner, tests/python/sglang_models.py) or "vllm" (vLLM's
model as its loader builds it, in the checkpoint's BF16: tests/python/vllm_models.py), each
at tp 1 over gloo on the CPU.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Tuple

TOKEN = "cross-engine-secret"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sglang_load(path: str, extra: Dict[str, Any]) -> Tuple[Any, Any]:
    """(SGLang's model loaded by weightstream, a function giving SGLang's default load of a checkpoint)."""
    import sglang_models  # noqa: PLC0415

    sglang_models.prepare_sglang(1)
    runner = sglang_models.build(path, 1, 0, False, "weightstream", free_port(), extra)
    return runner.model, lambda checkpoint: sglang_models.default_load_of(runner, checkpoint)


def vllm_load(path: str, extra: Dict[str, Any]) -> Tuple[Any, Any]:
    """(vLLM's model loaded by weightstream, a function giving vLLM's default load of a
    checkpoint), in the checkpoint's BF16 as vLLM's loader builds it."""
    import vllm_models  # noqa: PLC0415

    import weightstream.vllm as ws_vllm  # noqa: PLC0415

    ws_vllm.register()
    model, loader, _ = vllm_models.build(path, 1, False, "weightstream", extra, model_dtype=True)
    model._cross_engine_loader = loader  # the loader keeps its last_load; the model keeps the loader
    return model, lambda checkpoint: vllm_models.build(checkpoint, 1, False, "safetensors", model_dtype=True)[0]


def differences(engine: str, ours: Any, reference: Any) -> list:
    module = __import__("sglang_models" if engine == "sglang" else "vllm_models")
    return module.differences(ours, reference)


def serve(engine: str, ready: str, stop: str, paths: List[str]) -> None:
    extra = {"serve": "127.0.0.1:0", "peer_token": TOKEN}
    served: Dict[str, Any] = {}
    models = []
    for path in paths:
        model, _ = sglang_load(path, extra) if engine == "sglang" else vllm_load(path, extra)
        models.append(model)  # each serves for as long as its model lives
        served[path] = {"address": model._weightstream_server.address,
                        "digest": model._weightstream_server.content_digest,
                        "layout": model._weightstream_binding.description}
    with open(ready + ".tmp", "w") as file:
        json.dump(served, file)
    os.rename(ready + ".tmp", ready)
    while not os.path.exists(stop):
        time.sleep(0.1)


def pull(engine: str, config_folder: str, uri: str, digest: str, checkpoint: str) -> Dict[str, Any]:
    extra = {"model_uri": uri, "peer_token": TOKEN, "peer_expect_digest": digest}
    try:
        model, default_load = sglang_load(config_folder, extra) if engine == "sglang" else \
            vllm_load(config_folder, extra)
        last_load = getattr(model, "_weightstream_last_load", None) or model._cross_engine_loader.last_load
        return {"load": dict(last_load), "differences": differences(engine, model, default_load(checkpoint)),
                "parameters": sum(1 for _ in model.parameters()), "ok": True}
    except BaseException as error:  # noqa: BLE001 - reported to the test
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def main() -> None:
    command, engine = sys.argv[1:3]
    if engine == "vllm":
        import vllm_models  # noqa: PLC0415

        with vllm_models.parallel_state(1, 0, free_port()):
            run(command, engine)
    else:
        run(command, engine)


def run(command: str, engine: str) -> None:
    if command == "serve":
        serve(engine, sys.argv[3], sys.argv[4], sys.argv[5:])
        return
    with open(sys.argv[3]) as file:
        plan = json.load(file)
    results = [pull(engine, **item) for item in plan]
    with open(sys.argv[4], "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
