"""weightstream inside SGLang 0.5.23's real model classes, on the CPU: LlamaForCausalLM,
Qwen3MoeForCausalLM (fused experts.w13_weight / w2_weight) and DeepseekV3ForCausalLM (MLA's
fused_qkv_a_proj_with_mqa, experts, and the w_kc / w_vc SGLang derives after a load), BF16
and (the MoE families) FP8 block-scaled, at tp 1, tp 2 and (MoE) tp 2 with expert parallelism.

Checkpoints are written by transformers' save_pretrained. Each model is built by SGLang's own
ModelRunner with ``--load-format weightstream`` (weightstream.sglang, registered through
SGLang's ``sglang.srt.plugins`` entry point) and compared with a model SGLang's own
DefaultModelLoader builds and fills from the same checkpoint: every parameter equal bit for
bit, nothing through load_weights, each rank reading only its share. Then an update to
checkpoint B goes through SGLang's update API (begin_weight_update,
update_weights_from_tensor with weightstream's custom weight loader, end_weight_update),
pushed over shm by weightstream.UpdateSender, back to A over tcp, to B over ucx, and to A again
through SGLang's update_weights_from_disk: each equal to SGLang's default load of the same checkpoint, every address unchanged; an update with a wrongly
shaped tensor is refused whole. And an SGLang instance pulls its weights from a serving one
(``peer://``), reading nothing from storage.

On a CPU without AMX SGLang's FP8 methods refuse to repack their weights; the scenario
processes make that step a no-op for both loads (tests/python/sglang_models.py), so FP8
weights stay as loaded and the comparison is exact.

The scenarios run in five processes (tp 1; two ranks at tp 2; two at tp 2 with expert
parallelism; gloo) started once for the module (tests/python/sglang_models.py). Skipped
without SGLang; scripts/sglang-test.sh makes an environment with it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (scripts/sglang-test.sh installs it)")
pytest.importorskip("transformers", reason="transformers writes the checkpoints")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from engine_checkpoints import write_changed_variant  # noqa: E402
from sglang_models import write_fallback_checkpoint, write_sglang_checkpoint  # noqa: E402

MIB = 1 << 20
#: moto's S3 server, started by scripts/sglang-test.sh where moto is installed.
S3_ENDPOINT = os.environ.get("WS_TEST_S3_ENDPOINT")
CLASSES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
#: SGLang 0.5.23's Llama loads no block scales of an FP8 checkpoint (it renames
#: weight_scale_inv to weight_scale, which its FP8 block method does not have): no oracle.
BOTH = (("llama", "bf16"), ("qwen3_moe", "bf16"), ("deepseek_v3", "bf16"), ("qwen3_moe", "fp8"),
        ("deepseek_v3", "fp8"))
MOE = tuple((family, kind) for family, kind in BOTH if family != "llama")
#: (tp, expert parallel) of each process group, and the (family, kind) it runs.
GROUPS = {(1, False): BOTH, (2, False): BOTH, (2, True): MOE}


#: (tp, expert parallel, family) of the peer scenarios: an SGLang instance pulls from a serving one.
PEERS = ((1, False, "llama"), (2, False, "qwen3_moe"), (2, True, "qwen3_moe"))

#: (tp, expert parallel, family, kind) of the MTP draft scenarios: a checkpoint with its MTP
#: layer, SGLang's target and its NextN draft (tests/python/sglang_drafts.py).
DRAFTS = ((1, False, "deepseek_v3", "bf16"), (1, False, "deepseek_v3", "fp8"), (2, False, "deepseek_v3", "bf16"),
          (2, True, "deepseek_v3", "fp8"), (1, False, "glm4_moe", "bf16"), (1, False, "glm4_moe", "fp8"),
          (2, True, "glm4_moe", "bf16"))
DRAFT_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLMNextN", "glm4_moe": "Glm4MoeForCausalLMNextN"}


def group_name(tp, ep):
    return f"tp{tp}{'-ep' if ep else ''}"


def scenarios():
    for (tp, ep), runs in GROUPS.items():
        for family, kind in runs:
            yield family, kind, group_name(tp, ep)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_environment():
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    if S3_ENDPOINT:
        env.update(AWS_ENDPOINT_URL=S3_ENDPOINT, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_REGION="us-east-1")
    return env


def upload_to_s3(local, root):
    """The checkpoint at ``local`` in moto's S3, and a folder of its config.json only."""
    import boto3

    client = boto3.client("s3", endpoint_url=S3_ENDPOINT, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket="sglang-models")
    for file in sorted(Path(local).iterdir()):
        client.upload_file(str(file), "sglang-models", f"llama/{file.name}")
    config_folder = root / "llama-config-only"
    config_folder.mkdir()
    (config_folder / "config.json").write_text((Path(local) / "config.json").read_text())
    return {"uri": "s3://sglang-models/llama", "config_folder": str(config_folder)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Runs every scenario: the tp-1 process and the ranks of both tp-2 groups at once."""
    root = tmp_path_factory.mktemp("sglang-models")
    paths = {}
    for family, kind in BOTH:
        for name, seed in (("a", 1), ("b", 2)):
            folder = str(root / f"{family}-{kind}-{name}")
            write_sglang_checkpoint(family, folder, seed, fp8=kind == "fp8")
            paths[f"{family}-{kind}-{name}"] = folder
        if kind == "bf16":  # B after one step: 1% of its elements changed (the delta scenarios)
            paths[f"{family}-bf16-b1"] = write_changed_variant(paths[f"{family}-bf16-b"], str(root / f"{family}-bf16-b1"),
                                                               0.01, seed=7)
    for family in DRAFT_CLASSES:
        for kind in ("bf16", "fp8"):
            for name, seed in (("a", 1), ("b", 2)):
                folder = str(root / f"{family}-{kind}-mtp-{name}")
                paths[f"{family}-{kind}-mtp-{name}"] = write_sglang_checkpoint(family, folder, seed, fp8=kind == "fp8",
                                                                               mtp=True)
    paths["fallback"] = write_fallback_checkpoint(str(root / "qwen2"), 3)
    s3 = upload_to_s3(paths["llama-bf16-a"], root) if S3_ENDPOINT else None
    processes = []
    plans = {}
    for (tp, ep), runs in GROUPS.items():
        group = group_name(tp, ep)
        plan = [{"family": family, "fp8": kind == "fp8", "ep": ep, "update": True, "id": f"{family}-{kind}-{group}"}
                for family, kind in runs]
        plan += [{"family": family, "ep": ep, "special": "peer", "id": f"{family}-peer-{group}"}
                 for peer_tp, peer_ep, family in PEERS if (peer_tp, peer_ep) == (tp, ep)]
        plan += [{"family": family, "fp8": kind == "fp8", "ep": ep, "special": "draft",
                  "id": f"draft-{family}-{kind}-{group}"}
                 for draft_tp, draft_ep, family, kind in DRAFTS if (draft_tp, draft_ep) == (tp, ep)]
        if (tp, ep) == (1, False):
            plan.append({"family": "qwen2", "special": "fallback", "id": "fallback"})
            plan.append({"family": "llama", "special": "replaced", "id": "replaced"})
            if s3 is not None:
                plan.append(dict(s3, family="llama", special="s3", id="s3"))
            if torch.cuda.is_available():
                plan.append({"family": "llama", "special": "cuda-ipc", "id": "cuda-ipc"})
        plans[group] = (tp, plan)
        plan_path = root / f"plan-{group}.json"
        plan_path.write_text(json.dumps({"scenarios": plan, "paths": paths}))
        port = free_port()
        for rank in range(tp):
            log = open(root / f"{group}-rank{rank}.log", "w")
            processes.append((subprocess.Popen(
                [sys.executable, str(HERE / "sglang_models.py"), "run", "--tp", str(tp), "--rank", str(rank),
                 "--port", str(port), "--plan", str(plan_path), "--out", str(root / group)],
                stdout=log, stderr=subprocess.STDOUT, env=rank_environment()),
                log, group, rank))
    for process, log, group, rank in processes:
        code = process.wait(timeout=1200)
        log.close()
        if code != 0:
            tail = (root / f"{group}-rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"{group} rank {rank} exited {code}:\n{tail}")
    collected = {}
    for group, (tp, plan) in plans.items():
        for index, scenario in enumerate(plan):
            collected[scenario["id"]] = [json.loads((root / group / f"{index}-rank{rank}.json").read_text())
                                         for rank in range(tp)]
    return collected


def ranks_of(results, family, kind, parallel):
    ranks = results[f"{family}-{kind}-{parallel}"]
    for rank, result in enumerate(ranks):
        assert result["ok"], f"rank {rank}:\n{result.get('error')}"
    return ranks


@pytest.mark.parametrize("family,kind,parallel", list(scenarios()))
def test_a_weightstream_load_equals_sglangs_default_loader_and_binds_everything(results, family, kind, parallel):
    for rank, result in enumerate(ranks_of(results, family, kind, parallel)):
        where = f"{family} {kind} {parallel} rank {rank}"
        load = result["load"]
        assert result["class"] == CLASSES[family]
        assert load["path"] == "layout", where
        assert result["load_differences"] == [], f"{where}: parameters differ from SGLang's default loader"
        assert result["parameters"] > 0
        # Nothing went through load_weights, the layout allocated nothing, and the log says so.
        assert load["tensors_through_load_weights"] == 0 and load["parameters_through_load_weights"] == 0, where
        assert result["unbound"] == {} and result["by_load_weights"] == [], where
        assert result["layout_allocated_bytes"] == 0, where
        assert any("nothing through load_weights" in message for message in result["log"]), result["log"]
        if kind == "fp8":
            assert "torch.float8_e4m3fn" in result["dtypes"], where
        # Each rank reads its share, within 1 MiB.
        assert result["share"] <= load["bytes_read"] <= result["share"] + MIB, \
            (where, load["bytes_read"], result["share"])
        if parallel != "tp1":
            assert load["bytes_read"] < result["checkpoint_bytes"], where


@pytest.mark.parametrize("family,kind", MOE)
def test_an_expert_parallel_rank_reads_only_its_own_experts(results, family, kind):
    for rank, result in enumerate(ranks_of(results, family, kind, "tp2-ep")):
        assert result["layout"] == f"{family} tp 2 rank {rank} ep 2 rank {rank}"
        others = result["other_experts"]
        assert others, "the other rank's experts are in the checkpoint"
        # 8 experts over 2 ranks: rank r holds experts 4r to 4r + 3 (SGLang's placement).
        indices = {int(re.search(r"\.experts\.(\d+)\.", name).group(1)) for name in others}
        assert indices == set(range(8)) - set(range(4 * rank, 4 * rank + 4)), indices
        assert result["load"]["bytes_read"] == result["planned"] <= result["share"] + MIB


@pytest.mark.parametrize("family,kind,parallel", list(scenarios()))
def test_an_update_through_sglangs_update_api_lands_every_weight_in_place(results, family, kind, parallel):
    """Over shm, checkpoint B (FP8: B's BF16 weights, quantized in place by the receiver into
    the FP8 weights and their block scales), equal to SGLang's default load of B; then over
    tcp back to A (FP8: A's codes, then their scales in later buckets), equal to its load of A;
    then over ucx (UCX's shared-memory or tcp lanes on one host) to B again (FP8: B's codes
    beside their scales), equal to its load of B."""
    for rank, result in enumerate(ranks_of(results, family, kind, parallel)):
        assert [update["transport"] for update in result["updates"]] == ["shm", "tcp", "ucx", "disk"]
        for update in result["updates"][:3]:
            where = f"{family} {kind} {parallel} rank {rank} over {update['transport']}"
            assert update["bytes"] > 0 and update["received"]["bytes"] > 0, where
            assert update["differences"] == [], f"{where}: stale or wrong parameters after the update"
            assert update["addresses_unchanged"], where
            assert update["through_load_weights"] == [], where
        assert any(f"rank {rank} received an update of" in message for message in result["log"]), result["log"]
        # Then SGLang's update_weights_from_disk of A with --load-format weightstream: its own
        # iterator through load_weights, into the same parameters.
        disk = result["updates"][3]
        assert disk["succeeded"], disk["message"]
        assert disk["differences"] == [] and disk["addresses_unchanged"], disk
        assert disk["through_load_weights"], "update_weights_from_disk goes through load_weights"


@pytest.mark.parametrize("family,kind,parallel", [s for s in scenarios() if s[1] == "bf16"])
def test_a_delta_through_sglangs_update_api_lands_only_each_ranks_changes_in_place(results, family, kind, parallel):
    """Issue 46: a full update names version B; the delta B -> B1 (1% changed) from it lands
    in place equal to SGLang's default load of B1, each changed tensor checked after it, a
    fraction of the full update's bytes moved."""
    for rank, result in enumerate(ranks_of(results, family, kind, parallel)):
        where = f"{family} {kind} {parallel} rank {rank}"
        delta = result["delta"]
        assert delta["differences"] == [], f"{where}: parameters differ from SGLang's load of B1: {delta['differences']}"
        assert delta["addresses_unchanged"], where
        assert delta["version"] == "b1" * 8, (where, delta["version"])
        assert delta["sparse_tensors"] > 0 and delta["checked_tensors"] == delta["sparse_tensors"], (where, delta)
        assert 0 < delta["bytes"] < delta["full_bytes"] / 5, (where, delta["bytes"], delta["full_bytes"])
        if parallel != "tp1":  # each rank receives about its share of the tp-1 rank's delta, not all of it
            (whole,) = ranks_of(results, family, kind, "tp1")
            assert delta["bytes"] < 0.8 * whole["delta"]["bytes"], (where, delta["bytes"], whole["delta"]["bytes"])


@pytest.mark.parametrize("family,kind,parallel", list(scenarios()))
def test_an_update_with_a_wrongly_shaped_tensor_is_refused_whole(results, family, kind, parallel):
    for rank, result in enumerate(ranks_of(results, family, kind, parallel)):
        refused = result["refused"]
        assert "refused the update: the update's manifest of" in refused["error"], refused["error"]
        assert f"tensor {refused['last']} has shape [257]" in refused["error"], refused["error"]
        assert "nothing of it was applied" in refused["error"]
        # Still SGLang's default load of A (what the updates before it left).
        assert refused["differences"] == [], refused["differences"]


@pytest.mark.parametrize("tp,ep,family", PEERS)
def test_an_sglang_instance_pulls_its_weights_from_a_serving_one(results, tp, ep, family):
    """Instance A (``serve``) loads from the checkpoint and serves its bound parameters;
    instance B, whose model folder holds config.json only, loads with ``model_uri`` A's
    ``peer://`` URI and A's content digest pinned: every parameter equals SGLang's default
    loader's, nothing read from storage, nothing through load_weights."""
    for rank, result in enumerate(results[f"{family}-peer-{group_name(tp, ep)}"]):
        assert result["ok"], f"rank {rank}:\n{result.get('error')}"
        where = f"{family} tp {tp} rank {rank}"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", result["serving"]), where
        load = result["load"]
        assert load["source"] == result["uri"] and load["path"] == "layout", where
        assert load["bytes_read"] == 0 and load["bytes_from_peers"] > 0, (where, load)
        assert load["tensors_through_load_weights"] == 0 and result["unbound"] == {}, where
        assert result["parameters"] > 0
        assert result["load_differences"] == [], f"{where}: parameters differ from SGLang's default loader"


def test_a_model_without_a_layout_loads_through_load_weights_and_refuses_updates(results):
    """SGLang's Qwen2ForCausalLM (weightstream has no qwen2 table): loaded entirely through
    its load_weights, fed by weightstream's streamer, equal to SGLang's default load, the log
    saying why once; a pushed update is refused with the reason."""
    (result,) = results["fallback"]
    assert result["ok"], result.get("error")
    assert result["class"] == "Qwen2ForCausalLM"
    assert result["load"]["path"] == "load_weights" and result["load"]["tensors_through_load_weights"] > 0
    assert result["load_differences"] == []
    assert any("no layout for Qwen2ForCausalLM (model_type 'qwen2'): it loads through the model's load_weights"
               in message for message in result["log"]), result["log"]
    assert "weightstream updates need a model weightstream has a layout for" in result["update_error"], \
        result["update_error"]
    assert "Qwen2ForCausalLM has none (model_type 'qwen2')" in result["update_error"]


def test_an_update_into_a_parameter_the_model_replaced_is_refused_before_its_first_byte(results):
    """SGLang's Llama, one bound parameter replaced by new storage after the load: the update
    is refused naming it, every parameter as it was, the trainer told the engine's reason."""
    (result,) = results["replaced"]
    assert result["ok"], result.get("error")
    error = result["error"]
    assert "refused the update: cannot update llama tp 1 rank 0 in place: parameters the model replaced since " \
           "they were bound (SGLang's process_weights_after_loading transforms them)" in error, error
    assert result["parameter"] in error and "nothing was written" in error, error
    assert result["unchanged"]


@pytest.mark.skipif(not S3_ENDPOINT, reason="WS_TEST_S3_ENDPOINT is not set: no S3 server for this run "
                                            "(scripts/sglang-test.sh starts moto's when it is installed)")
def test_a_model_whose_folder_holds_its_config_only_loads_from_s3(results):
    """SGLang's model folder holds config.json only; weightstream loads the weights from
    s3:// (extra-config model_uri) into SGLang's Llama, equal to SGLang's default load of the
    same files, nothing through load_weights, reading the rank's share."""
    (result,) = results["s3"]
    assert result["ok"], result.get("error")
    load = result["load"]
    assert load["source"] == "s3://sglang-models/llama" and load["path"] == "layout", load
    assert result["load_differences"] == [] and result["unbound"] == {}
    assert load["tensors_through_load_weights"] == 0
    assert result["share"] <= load["bytes_read"] <= result["share"] + MIB, (load["bytes_read"], result["share"])


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA IPC needs an NVIDIA GPU and its driver (torch.cuda.is_available() is False here): "
                           "the cuda-ipc update into SGLang runs where SGLang is installed beside a GPU")
def test_an_update_over_cuda_ipc_from_the_trainers_gpu_lands_in_place(results):
    """Checkpoint B's tensors on the trainer's GPU, pushed over cuda-ipc through SGLang's update
    API (push_update with device "cuda:0", the receiver UpdateReceiver as for every transport,
    the path the vLLM backend takes): equal to SGLang's default load of B, every address
    unchanged, nothing through load_weights."""
    (result,) = results["cuda-ipc"]
    assert result["ok"], result.get("error")
    assert result["bytes"] > 0 and result["received"]["bytes"] > 0, result
    assert result["differences"] == [], "stale or wrong parameters after the update over cuda-ipc"
    assert result["addresses_unchanged"] and result["through_load_weights"] == []
    assert any("received an update of llama tp 1 rank 0 over cuda-ipc" in message for message in result["log"]), \
        result["log"]


@pytest.mark.parametrize("tp,ep,family,kind", DRAFTS)
def test_the_nextn_draft_loads_bound_from_the_targets_checkpoint_and_takes_updates(results, tp, ep, family, kind):
    """One DeepSeek-V3 (or GLM-4.5) checkpoint with its MTP layer (model.layers.{num_hidden_layers}.*):
    SGLang's target reads none of the MTP layer's bytes, and SGLang's DeepseekV3ForCausalLMNextN
    (Glm4MoeForCausalLMNextN),
    built by its draft ModelRunner (is_draft_worker) and loaded with --load-format weightstream,
    equals SGLang's default loader's draft, nothing through load_weights, reading its share
    (the MTP layer but the embedding and head SGLang gives it from the target). Then
    checkpoint B pushed through SGLang's update API into the target and, in the same call,
    the draft (FP8: BF16 weights quantized in place) equals SGLang's default loads of B, every
    address unchanged; a request that names no draft receivers is refused by the draft."""
    for rank, result in enumerate(results[f"draft-{family}-{kind}-{group_name(tp, ep)}"]):
        assert result["ok"], f"rank {rank}:\n{result.get('error')}"
        where = f"{family} draft {kind} tp {tp} rank {rank}"
        assert result["class"] == DRAFT_CLASSES[family], where
        for role, module in result["modules"].items():
            load = module["load"]
            assert load["role"] == role and load["path"] == "layout", (where, role)
            assert module["differences"] == [], f"{where}: the {role}'s parameters differ from SGLang's default loader"
            assert load["tensors_through_load_weights"] == 0 and module["unbound"] == {}, (where, role)
            assert module["layout_allocated_bytes"] == 0, (where, role)
            assert module["share"] <= load["bytes_read"] <= module["share"] + MIB, (where, role, load["bytes_read"])
        assert result["bound_from_target"] == [], where
        assert any(f"cold load of the draft ({family} tp" in message and "(draft)) from" in message and
                   "nothing through load_weights" in message for message in result["log"]), result["log"]
        update = result["update"]
        assert update["engine"] == [True, "Success"], where
        assert update["draft_bytes"] > 0 and update["received"]["bytes"] == update["draft_bytes"], where
        assert update["target_differences"] == [] and update["draft_differences"] == [], \
            f"{where}: stale or wrong parameters after the update"
        assert update["addresses_unchanged"] == {"target": True, "draft": True}, where
        assert update["through_load_weights"] == {"target": [], "draft": []}, where
        assert any(f"rank {rank} received an update of {family} tp {tp} rank {rank}" in message and
                   "(draft) over shm" in message for message in result["log"]), result["log"]
        assert f"SGLang hands the update to the speculative draft ({DRAFT_CLASSES[family]}) too, and the " \
               "request names no receivers for it" in update["refused"], update["refused"]
