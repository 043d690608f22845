"""A live ``sglang.Engine`` (SGLang 0.5.23, on the CPU) with ``--load-format weightstream``:
it generates, takes an update pushed by weightstream's UpdateSender through the Engine's own
update API, and then generates what an Engine loaded by SGLang's default loader from the new
checkpoint generates: the same greedy tokens, the same log-probabilities. A refused update
reaches the Engine's caller as an error and leaves the model serving as it was.

The Engine runs in a process of its own (tests/python/sglang_engine.py: SGLang's scheduler
processes import the main module). Skipped without SGLang; scripts/sglang-test.sh makes an
environment with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (scripts/sglang-test.sh installs it)")
pytest.importorskip("transformers", reason="transformers writes the checkpoints")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sglang_models import write_sglang_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-engine")
    a = write_sglang_checkpoint("llama", str(root / "llama-a"), 1)
    b = write_sglang_checkpoint("llama", str(root / "llama-b"), 2)
    out = root / "engine.json"
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    with open(root / "engine.log", "w") as log:
        code = subprocess.run([sys.executable, str(HERE / "sglang_engine.py"), a, b, str(out)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    if code != 0 or not out.exists():
        pytest.fail(f"the Engine process exited {code}:\n{(root / 'engine.log').read_text()[-4000:]}")
    result = json.loads(out.read_text())
    assert result["ok"], result["error"]
    return result


def test_an_update_through_the_engines_api_generates_what_sglangs_load_of_the_new_checkpoint_does(engine):
    assert engine["begin"] == [True, "Success"] and engine["end"] == [True, "Success"]
    assert engine["update"]["error"] == "" and engine["update"]["engine"] == [True, "Success"]
    assert engine["update"]["bytes"] > 0
    assert engine["a"]["tokens"] != engine["b_default"]["tokens"], "checkpoints A and B generate alike"
    # The same greedy tokens, log-probabilities and top-5 candidates as SGLang's own load of B.
    assert engine["b_updated"] == engine["b_default"]


def test_a_refused_update_reaches_the_engines_caller_and_the_engine_serves_on_unchanged(engine):
    refused = engine["refused"]["error"]
    assert "refused the update: the update's manifest of" in refused, refused
    assert f"tensor {engine['refused']['last']} has shape [257]" in refused, refused
    assert "nothing of it was applied" in refused
    assert engine["after_refused"] == engine["b_updated"]
    # SGLang 0.5.23 would let the custom weight loader's exception end its scheduler; the
    # Engine answers (False, why) instead.
    success, message = engine["not_a_request"]
    assert success is False
    assert message.startswith("weightstream.sglang.receive_update failed: weightstream.sglang.receive_update takes "
                              "the one tensor weightstream.sglang.update_request makes"), message
    # An update outside begin_weight_update / end_weight_update: SGLang's answer, raised.
    outside = engine["outside_session"]["error"]
    assert "SGLang's update_weights_from_tensor failed: update_weights_from_tensor must run between " \
           "begin_weight_update() and end_weight_update()" in outside, outside
    assert engine["after_outside_session"] == engine["b_updated"]
