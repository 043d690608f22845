"""Pulls between an SGLang 0.5.23 instance and a vLLM instance (``peer://``), each engine in
its own environment (tests/python/cross_engine_peers.py): an SGLang Llama whose model folder
holds config.json only pulls from a serving vLLM Llama, and a vLLM Llama from a serving
SGLang one, each equal to its own engine's default load of the checkpoint, reading nothing
from storage. Where the engines hold a parameter differently the pull reslices it: vLLM pads a
vocabulary of 1000 to 1024 rows, SGLang at tp 1 holds 1000, and an SGLang Llama of that
vocabulary pulled from vLLM still equals SGLang's default load, its embedding and lm_head
assembled in staging rather than read in place. Where the layouts disagree (a Qwen3-MoE
instance pointed at a serving Llama, whichever engine serves), the pull is refused before a
byte is read, naming the parameter and the tensor the peers lack, and the instance, whose
model folder holds config.json only, does not load.

Needs vLLM's environment beside SGLang's: WS_VLLM_VENV (scripts/sglang-test.sh passes it on;
build/venv-vllm when scripts/vllm-test.sh made it there), with the same Python version; skipped
without it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (scripts/sglang-test.sh installs it)")
pytest.importorskip("transformers", reason="transformers writes the checkpoints")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from engine_checkpoints import write_checkpoint  # noqa: E402
from sglang_models import write_sglang_checkpoint  # noqa: E402

VLLM_VENV = os.environ.get("WS_VLLM_VENV", "")
VLLM_PYTHON = os.path.join(VLLM_VENV, "bin", "python") if VLLM_VENV else ""
pytestmark = pytest.mark.skipif(not VLLM_PYTHON or not os.path.exists(VLLM_PYTHON),
                                reason="WS_VLLM_VENV names no environment with vLLM (scripts/vllm-test.sh makes one)")
PYTHONS = {"sglang": sys.executable, "vllm": VLLM_PYTHON}


def start(engine, arguments, log):
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([PYTHONS[engine], str(HERE / "cross_engine_peers.py"), *arguments], stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def wait_ready(process, ready, log_path):
    deadline = time.monotonic() + 600
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the serving instance exited {process.poll()}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    return json.loads(ready.read_text())


def config_only(root, checkpoint):
    folder = root / f"{Path(checkpoint).name}-config-only"
    folder.mkdir()
    (folder / "config.json").write_text((Path(checkpoint) / "config.json").read_text())
    return str(folder)


@pytest.fixture(scope="module")
def pulls(tmp_path_factory):
    """vLLM serves Llama (vocabularies of 1024 and 1000) while SGLang serves Llama (1024); then
    SGLang pulls both from vLLM and vLLM pulls Llama from SGLang; last, each engine's Qwen3-MoE
    (its folder of config.json only) pulls from the other's Llama, which the layouts refuse."""
    root = tmp_path_factory.mktemp("sglang-vllm-peers")
    llama = write_sglang_checkpoint("llama", str(root / "llama"), 1)
    padded = write_checkpoint("llama", str(root / "llama-vocab-1000"), 1)  # engine_checkpoints' vocabulary: 1000
    moe = write_sglang_checkpoint("qwen3_moe", str(root / "qwen3_moe"), 1)
    stop = root / "stop"
    servers = {}
    for engine, paths in (("vllm", [llama, padded]), ("sglang", [llama])):
        log_path = root / f"serve-{engine}.log"
        log = open(log_path, "w")
        servers[engine] = (start(engine, ["serve", engine, str(root / f"ready-{engine}"), str(stop), *paths], log),
                           log, log_path)
    try:
        served = {engine: wait_ready(process, root / f"ready-{engine}", log_path)
                  for engine, (process, _, log_path) in servers.items()}
        # (the server, the checkpoint it serves, the checkpoint whose config.json the puller has)
        plans = {"sglang": [(served["vllm"], llama, llama), (served["vllm"], padded, padded),
                            (served["vllm"], llama, moe)],
                 "vllm": [(served["sglang"], llama, llama), (served["sglang"], llama, moe)]}
        results = {}
        for engine, plan in plans.items():
            (root / engine).mkdir()
            items = [{"config_folder": config_only(root / engine, path), "uri": "peer://" + server[serving]["address"],
                      "digest": server[serving]["digest"], "checkpoint": path} for server, serving, path in plan]
            (root / f"plan-{engine}.json").write_text(json.dumps(items))
            with open(root / f"pull-{engine}.log", "w") as log:
                code = start(engine, ["pull", engine, str(root / f"plan-{engine}.json"),
                                      str(root / f"pulled-{engine}.json")], log).wait(timeout=900)
            if code != 0:
                pytest.fail(f"the pulling {engine} exited {code}:\n{(root / f'pull-{engine}.log').read_text()[-4000:]}")
            results[engine] = json.loads((root / f"pulled-{engine}.json").read_text())
    finally:
        stop.touch()
        for process, log, _ in servers.values():
            process.wait(timeout=120)
            log.close()
    return {"served": served, "results": results, "llama": llama}


@pytest.mark.parametrize("puller,server", [("sglang", "vllm"), ("vllm", "sglang")])
def test_an_instance_of_one_engine_pulls_llama_from_the_other(pulls, puller, server):
    result = pulls["results"][puller][0]
    assert result["ok"], result.get("traceback")
    load = result["load"]
    assert pulls["served"][server][pulls["llama"]]["layout"] == "llama tp 1 rank 0"
    assert load["source"].startswith("peer://127.0.0.1:") and load["path"] == "layout", load
    assert load["bytes_read"] == 0 and load["bytes_from_peers"] > 0, load
    assert load["bytes_in_place"] == load["bytes_from_peers"], "the same layout: every parameter read in place"
    assert load["tensors_through_load_weights"] == 0
    assert result["parameters"] > 0
    assert result["differences"] == [], f"{puller}'s parameters differ from its own default load"


def test_a_vocabulary_the_engines_pad_differently_is_resliced_by_the_pull(pulls):
    result = pulls["results"]["sglang"][1]
    assert result["ok"], result.get("traceback")
    load = result["load"]
    assert load["bytes_read"] == 0 and load["tensors_through_load_weights"] == 0, load
    # vLLM's padded embedding and lm_head are not SGLang's: assembled in staging, not read in place.
    assert 0 < load["bytes_in_place"] < load["bytes_from_peers"], load
    assert result["differences"] == [], "SGLang's parameters differ from its own default load"


@pytest.mark.parametrize("puller,server", [("sglang", "vllm"), ("vllm", "sglang")])
def test_a_pull_the_layouts_cannot_serve_is_refused_naming_what_differs(pulls, puller, server):
    """A Qwen3-MoE instance of one engine (its model folder holds config.json only) pointed at
    the other engine's serving Llama: the puller's layout wants tensors the served checkpoint
    does not have (Qwen3's q_norm and k_norm, the experts). The pull is refused when the
    manifests arrive, before any byte is read (every wanted tensor is looked up first), naming
    the puller's parameter, the tensor and the peers; the instance does not load (its own
    sources hold no weights), and says both."""
    result = pulls["results"][puller][-1]
    assert not result["ok"], "a Qwen3-MoE layout loaded from a Llama's peers"
    error = result["error"]
    assert re.search(r"parameter model\.layers\.\d+\.\S+ of qwen3_moe tp 1 rank 0 wants tensor "
                     r"model\.layers\.\d+\.\S+, which the checkpoint served by peer://127\.0\.0\.1:\d+ does not have",
                     error), error
    # Then the model's own sources, which hold config.json only: the load fails naming both.
    assert "cannot load qwen3_moe tp 1 rank 0 from any source" in error, error
    assert pulls["served"][server][pulls["llama"]]["layout"] == "llama tp 1 rank 0"
