"""weightstream inside vLLM 0.33's real model classes, on the CPU: every family weightstream
binds (llama, qwen3, qwen3_moe, mixtral, deepseek_v3, kimi_k2, glm4_moe, qwen3_next), BF16 and
FP8 block-scaled, at tp 1, tp 2 and (MoE families) tp 2 with expert parallelism.

Checkpoints are written by transformers' save_pretrained (FP8: quantized from those BF16
weights by 128 x 128 blocks, amax / 448). Each model is built by vLLM's own
initialize_model and filled once by vLLM's default loader (the oracle) and once with
``--load-format weightstream``; every parameter must be equal bit for bit, nothing may go
through load_weights, and each rank reads only its share. Then updates are pushed through
the ``weightstream`` weight-transfer backend over shm and tcp (for FP8: BF16 weights
quantized by the receiver, and FP8 codes with their scales in later buckets), each compared
with vLLM's default load of the same weights, addresses unchanged.

The scenarios run in three processes (one at tp 1, two ranks at tp 2 over gloo) started once
for the module (tests/python/vllm_models.py); the tests below read their results. Skipped
without vLLM; scripts/vllm-test.sh makes an environment with it.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm-test.sh installs it)")
pytest.importorskip("transformers", reason="transformers writes the checkpoints")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from engine_checkpoints import write_changed_variant  # noqa: E402
from vllm_models import FAMILIES, MOE_FAMILIES, MTP_FAMILIES, write_checkpoint  # noqa: E402

MIB = 1 << 20
#: moto's S3 server, started by scripts/vllm-test.sh where moto is installed.
S3_ENDPOINT = os.environ.get("WS_TEST_S3_ENDPOINT")
PARALLEL = ("tp1", "tp2", "tp2-ep")
#: Scenarios that also take a delta update (issue 46): a MoE with expert parallelism, and an
#: FP8 block-scaled model at tp 2.
DELTA_SCENARIOS = (("qwen3_moe", "bf16", "tp2-ep"), ("deepseek_v3", "fp8", "tp2"))


def scenarios():
    for family in FAMILIES:
        for kind in ("bf16", "fp8"):
            for parallel in PARALLEL:
                if parallel == "tp2-ep" and family not in MOE_FAMILIES:
                    continue
                yield family, kind, parallel


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


#: (tp, family, expert parallel) of the peer scenarios: a vLLM instance pulls from a serving one.
PEER_SCENARIOS = ((1, "llama", False), (2, "qwen3_moe", False), (2, "qwen3_moe", True))


def peer_id(family, tp, ep):
    return f"{family}-peer-tp{tp}{'-ep' if ep else ''}"


def free_ports(count) -> int:
    """A port P with P to P + count - 1 free on loopback now (the peer servers' ports), below
    the kernel's ephemeral range: the scenario binds them minutes later, and by then a port the
    kernel hands out (a gloo or UCX connection's) may hold one (a run failed so: "cannot listen
    on 127.0.0.1:53098: Address already in use")."""
    lowest_ephemeral = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            lowest_ephemeral = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    while True:
        base = random.randrange(10000, max(10001, lowest_ephemeral - count))
        probes = []
        try:
            for offset in range(count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()


def rank_environment():
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    if S3_ENDPOINT:
        env.update(AWS_ENDPOINT_URL=S3_ENDPOINT, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_REGION="us-east-1")
    return env


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Runs every scenario: the tp-1 process and the two tp-2 ranks at once."""
    root = tmp_path_factory.mktemp("vllm-models")
    paths = {}
    for family in FAMILIES:
        for kind in ("bf16", "fp8"):
            for name, seed in (("a", 1), ("b", 2)):
                folder = str(root / f"{family}-{kind}-{name}")
                write_checkpoint(family, folder, seed, fp8=kind == "fp8")
                paths[f"{family}-{kind}-{name}"] = folder
    for family, kind, _ in DELTA_SCENARIOS:
        paths[f"{family}-{kind}-a1"] = write_changed_variant(
            paths[f"{family}-{kind}-a"], str(root / f"{family}-{kind}-a1"), 0.01, seed=7,
            bf16_source=paths[f"{family}-bf16-a"] if kind == "fp8" else None)
    for family in MTP_FAMILIES:
        for kind in ("bf16", "fp8"):
            folder = str(root / f"{family}-{kind}-mtp")
            write_checkpoint(family, folder, 5, fp8=kind == "fp8", mtp=True)
            paths[f"{family}-{kind}-mtp"] = folder
    plans = {1: [], 2: []}
    for family, kind, parallel in scenarios():
        tp = 1 if parallel == "tp1" else 2
        scenario = {"family": family, "fp8": kind == "fp8", "ep": parallel == "tp2-ep", "update": True,
                    "delta": (family, kind, parallel) in DELTA_SCENARIOS, "id": f"{family}-{kind}-{parallel}"}
        plans[tp].append(scenario)
    plans[1].append({"family": "llama", "fp8": False, "ep": False, "refused_update": True, "id": "refused"})
    plans[1].append({"family": "qwen3_moe", "fp8": True, "ep": False, "refused_manifests": True,
                     "id": "refused-manifests"})
    for tp, family, ep in PEER_SCENARIOS:
        plans[tp].append({"family": family, "fp8": False, "ep": ep, "peer": True, "port": free_ports(tp),
                          "id": peer_id(family, tp, ep)})
    if S3_ENDPOINT:
        # The seed's scenario: an FP8 MoE target with its MTP layer in one s3:// checkpoint.
        import boto3

        client = boto3.client("s3", endpoint_url=S3_ENDPOINT, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="vllm-models")
        local = Path(paths["deepseek_v3-fp8-mtp"])
        for file in sorted(local.iterdir()):
            client.upload_file(str(file), "vllm-models", f"deepseek-fp8-mtp/{file.name}")
        config_folder = root / "deepseek-config-only"
        config_folder.mkdir()
        (config_folder / "config.json").write_text((local / "config.json").read_text())
        plans[1].append({"family": "deepseek_v3", "fp8": True, "draft": True, "id": "s3-mtp",
                         "s3_uri": "s3://vllm-models/deepseek-fp8-mtp", "config_folder": str(config_folder)})
    for family in MTP_FAMILIES:
        for kind in ("bf16", "fp8"):
            plans[1].append({"family": family, "fp8": kind == "fp8", "draft": True, "id": f"{family}-{kind}-mtp"})
    processes = []
    for tp, plan in plans.items():
        plan_path = root / f"plan-tp{tp}.json"
        plan_path.write_text(json.dumps({"scenarios": plan, "paths": paths}))
        port = free_port()
        for rank in range(tp):
            log = open(root / f"tp{tp}-rank{rank}.log", "w")
            processes.append((subprocess.Popen(
                [sys.executable, str(HERE / "vllm_models.py"), "run", "--tp", str(tp), "--rank", str(rank),
                 "--port", str(port), "--plan", str(plan_path), "--out", str(root / f"tp{tp}")],
                stdout=log, stderr=subprocess.STDOUT, env=rank_environment()), log, tp, rank))
    for process, log, tp, rank in processes:
        code = process.wait(timeout=1500)
        log.close()
        if code != 0:
            tail = (root / f"tp{tp}-rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"tp {tp} rank {rank} exited {code}:\n{tail}")
    collected = {}
    for tp, plan in plans.items():
        for index, scenario in enumerate(plan):
            collected[scenario["id"]] = [json.loads((root / f"tp{tp}" / f"{index}-rank{rank}.json").read_text())
                                         for rank in range(tp)]
    return collected


def ranks_of(results, family, kind, parallel):
    ranks = results[f"{family}-{kind}-{parallel}"]
    for rank, result in enumerate(ranks):
        assert result["ok"], f"rank {rank}:\n{result.get('error')}"
    return ranks


@pytest.mark.parametrize("family,kind,parallel", list(scenarios()))
def test_a_weightstream_load_equals_vllms_default_loader_and_binds_everything(results, family, kind, parallel):
    for rank, result in enumerate(ranks_of(results, family, kind, parallel)):
        where = f"{family} {kind} {parallel} rank {rank}"
        load = result["load"]
        assert load["path"] == "layout", where
        assert result["load_differences"] == [], f"{where}: parameters differ from vLLM's default loader"
        assert result["parameters"] > 0
        # Nothing went through load_weights, the layout allocated nothing, and the log says so.
        assert load["tensors_through_load_weights"] == 0 and load["parameters_through_load_weights"] == 0, where
        assert result["unbound"] == {}, where
        assert result["layout_allocated_bytes"] == 0, where
        assert any("nothing through load_weights" in message for message in result["log"]), result["log"]
        if kind == "fp8":
            assert "torch.float8_e4m3fn" in result["dtypes"], where
        # Each rank reads its share, within 1 MiB: its row slices as ranges, and its columns of
        # row-split tensors (o_proj, down_proj, w2 and their FP8 block scales) as a run per row.
        assert result["share"] <= load["bytes_read"] <= result["share"] + MIB, \
            (where, load["bytes_read"], result["share"])
        if parallel != "tp1":
            assert load["bytes_read"] < result["checkpoint_bytes"], where


@pytest.mark.parametrize("family,kind", [(f, k) for f in MOE_FAMILIES for k in ("bf16", "fp8")])
def test_an_expert_parallel_rank_reads_only_its_own_experts(results, family, kind):
    for rank, result in enumerate(ranks_of(results, family, kind, "tp2-ep")):
        assert result["parallel"] == [2, rank, 2, rank]
        others = result["other_experts"]
        assert others, "the other rank's experts are in the checkpoint"
        # 8 experts over 2 ranks: rank r holds experts 4r to 4r + 3 (vLLM's linear placement).
        indices = {int(re.search(r"\.experts\.(\d+)\.", name).group(1)) for name in others}
        assert indices == set(range(8)) - set(range(4 * rank, 4 * rank + 4)), indices
        # None of them is planned or read: experts are whole on their rank, and the runs of
        # the row-split tensors are copied out of the files' mappings (--io auto), so what is
        # read is exactly the plan, which holds this rank's bytes only.
        assert result["load"]["bytes_read"] == result["planned"], (result["load"]["bytes_read"], result["planned"])
        assert result["planned"] <= result["share"] + MIB


@pytest.mark.parametrize("family,kind,parallel", list(scenarios()))
def test_pushed_updates_land_every_weight_in_place(results, family, kind, parallel):
    for rank, result in enumerate(ranks_of(results, family, kind, parallel)):
        where = f"{family} {kind} {parallel} rank {rank}"
        assert [u["transport"] for u in result["updates"]] == ["shm", "tcp", "ucx"]
        for update in result["updates"]:
            assert update["bytes"] > 0
            assert update["differences"] == [], f"{where} over {update['transport']}: stale or wrong parameters"
            assert update["addresses_unchanged"], where


@pytest.mark.parametrize("family,kind,parallel", DELTA_SCENARIOS)
def test_a_delta_update_lands_only_what_changed_in_place(results, family, kind, parallel):
    """Issue 46: the model holds A; a full update names its version; a delta from another
    version is refused before its first byte; the delta A -> A1 (1% of the elements changed;
    FP8: quantized by the sender, only changed codes and scales sent) leaves every parameter
    equal to vLLM's default load of A1, in place, moving a fraction of the full update's bytes."""
    for rank, result in enumerate(ranks_of(results, family, kind, parallel)):
        where = f"{family} {kind} {parallel} rank {rank}"
        delta = result["delta"]
        assert delta["before_differences"] == [], where
        assert "torch.bfloat16" in delta["dtypes"], (where, delta["dtypes"])  # built as vLLM's loader builds it
        full = delta["full"]
        assert full["trainer"] == full["worker"] == "" and full["differences"] == [], (where, full)
        wrong = delta["wrong_base"]
        assert f"the delta update applies to content digest {'0f' * 8} but this receiver holds {'a' * 16}" \
            in wrong["trainer"], (where, wrong)
        assert wrong["differences"] == [], f"{where}: a refused delta changed parameters: {wrong['differences']}"
        changed = delta["delta"]
        assert changed["trainer"] == changed["worker"] == "", (where, changed)
        assert changed["differences"] == [], f"{where}: parameters differ from vLLM's load of A1: {changed['differences']}"
        assert changed["addresses_unchanged"], where
        assert changed["sparse_tensors"] > 0, (where, changed)
        # What the rank holds of each tensor sent as changes was checked against the target.
        assert changed["checked_tensors"] == changed["sparse_tensors"], (where, changed)
        # Each rank receives only the changed elements it holds: about its share of the delta a
        # receiver of the whole model takes (what every rank received before), not all of it (a
        # tensor that goes dense goes whole: DeepSeek-V3's rank 0 measured 0.78, rank 1 0.55).
        assert changed["bytes"] < 0.85 * changed["whole_bytes"], (where, changed["bytes"], changed["whole_bytes"])
        assert 0 < changed["bytes"] < full["bytes"] / 5, (where, changed["bytes"], full["bytes"])
    # Together the ranks receive well under what each of them received before (the whole delta).
    ranks = ranks_of(results, family, kind, parallel)
    whole = ranks[0]["delta"]["delta"]["whole_bytes"]
    assert sum(rank["delta"]["delta"]["bytes"] for rank in ranks) < 0.7 * len(ranks) * whole, parallel


def test_an_update_that_cannot_land_in_place_fails_before_its_first_byte(results):
    (result,) = results["refused"]
    assert result["ok"], result.get("error")
    refused = result["refused_update"]
    assert f"cannot update llama tp 1 rank 0 in place: parameters the model replaced since they were bound" \
        in refused["error"], refused["error"]
    assert refused["parameter"] in refused["error"] and "nothing was written" in refused["error"]
    assert refused["unchanged"]
    # The trainer is told the engine's reason at once (it used to time out waiting for WELCOME).
    trainer = refused["trainer_error"]
    assert "refused the update: cannot update llama tp 1 rank 0 in place: parameters the model replaced" in trainer, \
        trainer
    assert refused["parameter"] in trainer and "timed out" not in trainer


def test_an_fp8_moe_update_is_checked_whole_before_its_first_byte(results):
    """vLLM's Qwen3-MoE, FP8, tp 1: an update whose last tensor is unknown or of a wrong shape,
    or whose FP8 codes come without their scale (or a scale without its codes), is refused
    before any byte lands; every parameter still equals vLLM's load of checkpoint A, and the trainer gets the
    receiver's reason."""
    (result,) = results["refused-manifests"]
    assert result["ok"], result.get("error")
    refused = result["refused_manifests"]
    assert refused["parameters"] > 30  # vLLM's Qwen3-MoE state: every parameter is compared below
    codes, last = refused["codes"], refused["last"]
    expected = {
        "unknown_last": "tensor model.layers.0.mlp.experts.0.rotary_blob.weight matches no parameter of",
        "wrong_shape_last": f"tensor {last} has shape",
        "codes_without_scale": f"FP8 weight {codes} is declared as F8_E4M3 codes without its block scales "
                               f"{codes}_scale_inv",
        "scale_without_codes": f"block scales {codes}_scale_inv are declared without their FP8 weight {codes}",
    }
    for case, text in expected.items():
        outcome = refused[case]
        assert outcome["differences"] == [], f"{case}: parameters changed: {outcome['differences']}"
        assert "refused the update: the update's manifest of" in outcome["trainer"], (case, outcome["trainer"])
        assert text in outcome["trainer"], (case, outcome["trainer"])
        assert "failed before any bucket arrived" in outcome["worker"] and text in outcome["worker"], \
            (case, outcome["worker"])


def test_a_moe_load_stays_within_vllms_default_load_plus_the_staging_limit(tmp_path):
    """Peak resident memory of a process that builds vLLM's Qwen3-MoE and loads about 200 MB
    of experts into it: weightstream's load may exceed vLLM's default load by at most its
    staging limit (a second copy of the experts, as the old layout kept, would be 400 MB)."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=1000, hidden_size=512, intermediate_size=512,
                                         moe_intermediate_size=512, num_experts=32, num_experts_per_tok=2,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=128, mlp_only_layers=[], max_position_embeddings=256)
    torch.manual_seed(3)
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(str(tmp_path / "moe"),
                                                                                 max_shard_size="64MB")
    limit = 64 * MIB

    def peak(load_format, extra):
        result = subprocess.run([sys.executable, str(HERE / "vllm_models.py"), "peak", "--path", str(tmp_path / "moe"),
                                 "--load-format", load_format, "--extra", json.dumps(extra)], capture_output=True,
                                text=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    theirs = peak("safetensors", {})
    ours = peak("weightstream", {"memory_limit": limit})
    assert ours["tensors_through_load_weights"] == 0
    assert ours["parameter_bytes"] == theirs["parameter_bytes"] > 300 * MIB  # float32 on vLLM's CPU platform
    assert ours["peak_rss_bytes"] <= theirs["peak_rss_bytes"] + limit, (ours, theirs)


@pytest.mark.parametrize("family,kind", [(f, k) for f in MTP_FAMILIES for k in ("bf16", "fp8")])
def test_the_mtp_draft_loads_bound_from_the_targets_checkpoint_into_vllms_draft_module(results, family, kind):
    """One checkpoint with its MTP layer: vLLM's target model reads none of the MTP bytes, and
    vLLM's own draft module (DeepSeekMTP, Glm4MoeMTP, Qwen3NextMTP, made through vLLM's
    speculative config) is bound and equals vLLM's default load of it."""
    (result,) = results[f"{family}-{kind}-mtp"]
    assert result["ok"], result.get("error")
    target, draft = result["modules"]["target"], result["modules"]["draft"]
    assert draft["class"] in ("DeepSeekMTP", "Glm4MoeMTP", "Qwen3NextMTP")
    assert draft["load"]["role"] == "draft" and target["load"]["role"] == "target"
    for role, module in (("target", target), ("draft", draft)):
        assert module["load"]["path"] == "layout", role
        assert module["differences"] == [], f"{role}: parameters differ from vLLM's default loader"
        assert module["unbound"] == {} and module["layout_allocated_bytes"] == 0, role
        assert module["load"]["bytes_read"] <= module["share"] + MIB, role
    assert target["load"]["tensors_through_load_weights"] == 0
    # Qwen3-Next's draft keeps an embedding and a head of its own, filled from the target's
    # tensors (vLLM shares the target's in serving): those two go through load_weights.
    expected = 2 if family == "qwen3_next" else 0
    assert draft["load"]["tensors_through_load_weights"] == expected


@pytest.mark.skipif(not S3_ENDPOINT, reason="WS_TEST_S3_ENDPOINT is not set: no S3 server for this run "
                                            "(scripts/vllm-test.sh starts moto's when it is installed)")
def test_an_fp8_moe_target_and_its_mtp_draft_load_from_one_s3_checkpoint(results):
    """vLLM's model folder holds config.json only; the FP8 DeepSeek-V3 target and its MTP
    draft both come from s3:// (the loader's model_uri), bound, equal to vLLM's default load
    of the same files, each reading only its own module's bytes."""
    (result,) = results["s3-mtp"]
    assert result["ok"], result.get("error")
    for role, module in result["modules"].items():
        assert module["load"]["source"] == "s3://vllm-models/deepseek-fp8-mtp", role
        assert module["load"]["path"] == "layout" and module["differences"] == [], role
        assert module["load"]["tensors_through_load_weights"] == 0, role
        assert module["load"]["bytes_read"] <= module["share"] + MIB, role


@pytest.mark.parametrize("tp,family,ep", PEER_SCENARIOS)
def test_a_vllm_instance_pulls_its_weights_from_a_serving_one(results, tp, family, ep):
    """Instance A (``serve``: HOST:PORT, port + rank) loads from the checkpoint and serves its
    bound parameters; instance B, whose model folder holds config.json only, loads with
    ``model_uri=peer://...``: every parameter equals vLLM's default loader's, nothing is read
    from storage, all of it lands in place, with A's content digest pinned (peer_expect_digest).
    A wrong token and a wrong digest are refused by name, and once A's model is gone its
    servers are too."""
    ranks = results[peer_id(family, tp, ep)]
    for rank, result in enumerate(ranks):
        assert result["ok"], f"rank {rank}:\n{result.get('error')}"
        where = f"{family} tp {tp} rank {rank}"
        base = result["scenario"]["port"]
        assert result["serving"] == f"127.0.0.1:{base + rank}", where
        assert result["served_differences"] == [], where
        load = result["load"]
        assert load["source"] == result["uri"] and load["path"] == "layout", where
        assert load["bytes_read"] == 0 and load["bytes_from_peers"] > 0, (where, load)
        assert load["tensors_through_load_weights"] == 0 and load["parameters_through_load_weights"] == 0, where
        assert result["unbound"] == {}, where
        assert result["parameters"] > 0
        assert result["load_differences"] == [], f"{where}: parameters differ from vLLM's default loader"
        assert "could not prove the token" in result["wrong_token"], result["wrong_token"]
        assert "peer-secret" not in result["wrong_token"]
        assert re.fullmatch(r"[0-9a-f]{16}", result["content_digest"]), where
        assert (f"do not serve the expected content digest {'0' * 16}: " in result["wrong_digest"] and
                f"serves {result['content_digest']}" in result["wrong_digest"]), result["wrong_digest"]
        assert "cannot connect to serving peer at 127.0.0.1:" in result["after_stop"], result["after_stop"]
        assert "cannot load" in result["after_stop"] and result["uri"] in result["after_stop"]
