"""A live ``sglang.Engine`` on the CPU with ``--load-format weightstream``, for the SGLang
stage (tests/python/test_sglang_engine.py).

Run as a script (``python sglang_engine.py A B OUT``), as SGLang's Engine wants a main module
its scheduler processes can import: an Engine of checkpoint A loaded by weightstream
generates; checkpoint B is pushed through the Engine's own update API (begin_weight_update,
update_weights_from_tensor with weightstream's custom weight loader, end_weight_update) and
it generates again; an update with a wrongly shaped tensor, named tensors the custom
weight loader refuses and an update outside a begin/end session are tried; then an Engine of checkpoint B loaded by SGLang's default loader
generates the same prompt. The results, JSON, go to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Dict, List, Tuple

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

#: The prompt (token ids: the engine runs without a tokenizer) and its greedy continuation.
PROMPT = [1, 5, 9, 22, 100, 7]
NEW_TOKENS = 4
TOKEN = "engine-update-secret"


def engine_of(path: str, load_format: str) -> Any:
    """SGLang's Engine of the checkpoint at ``path`` with the CPU recipe of issue 49."""
    import sglang  # noqa: PLC0415

    import weightstream.sglang as ws_sglang  # noqa: PLC0415

    return sglang.Engine(model_path=path, load_format=load_format, device="cpu", attention_backend="torch_native",
                         sampling_backend="pytorch", max_total_tokens=512, mem_fraction_static=0.9,
                         skip_tokenizer_init=True, dtype="bfloat16", custom_weight_loader=[ws_sglang.UPDATE_LOADER],
                         disable_cuda_graph=True, log_level="warning")


def generate(engine: Any) -> Dict[str, Any]:
    """The greedy tokens of PROMPT with their log-probabilities and the 5 likeliest at each step."""
    out = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0},
                          return_logprob=True, top_logprobs_num=5)
    meta = out["meta_info"]
    return {"tokens": out["output_ids"], "logprobs": [entry[0] for entry in meta["output_token_logprobs"]],
            "top": [[[entry[0], entry[1]] for entry in step] for step in meta["output_top_logprobs"]]}


def push(engine: Any, tensors: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """weightstream's push_update through the Engine's update_weights_from_tensor: what the
    Engine answered and the trainer's report, or the error the trainer got."""
    import weightstream.sglang as ws_sglang  # noqa: PLC0415

    try:
        report = ws_sglang.push_update(engine.update_weights_from_tensor, tensors, token=TOKEN, transport="shm",
                                       accept_timeout=60.0)
        return {"engine": list(report["engine"]), "bytes": report["senders"][0].get("bytes"), "error": ""}
    except Exception as error:  # noqa: BLE001 - its text is the result
        return {"error": f"{type(error).__name__}: {error}"}


def run(a: str, b: str) -> Dict[str, Any]:
    import torch  # noqa: PLC0415

    import weightstream.sglang as ws_sglang  # noqa: PLC0415
    from engine_checkpoints import checkpoint_tensors  # noqa: PLC0415

    result: Dict[str, Any] = {}
    engine = engine_of(a, "weightstream")
    try:
        result["a"] = generate(engine)
        tensors = sorted(checkpoint_tensors(b).items())
        result["begin"] = list(engine.begin_weight_update())
        result["update"] = push(engine, tensors)
        result["end"] = list(engine.end_weight_update())
        result["b_updated"] = generate(engine)
        name, last = tensors[-1]
        wrong = tensors[:-1] + [(name, torch.zeros(*last.shape[:-1], last.shape[-1] + 1, dtype=last.dtype))]
        engine.begin_weight_update()
        result["refused"] = dict(push(engine, wrong), last=name)
        engine.end_weight_update()
        result["after_refused"] = generate(engine)
        # What the Engine's caller gets when the custom weight loader raises: named tensors
        # that are not a request.
        engine.begin_weight_update()
        result["not_a_request"] = list(engine.update_weights_from_tensor(named_tensors=tensors[:1],
                                                                         load_format=ws_sglang.UPDATE_LOADER))
        engine.end_weight_update()
        result["outside_session"] = push(engine, tensors)
        result["after_outside_session"] = generate(engine)
    finally:
        engine.shutdown()
    engine = engine_of(b, "auto")
    try:
        result["b_default"] = generate(engine)
    finally:
        engine.shutdown()
    return result


def main() -> None:
    a, b, out = sys.argv[1:4]
    try:
        result = dict(run(a, b), ok=True)
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "error": traceback.format_exc()}
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
