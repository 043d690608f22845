"""The known speculative-draft failure, end to end with the command: a deepseek_v3 checkpoint
with MTP layers (`weightstream synth`, fixed seed) uploaded with boto3 to the S3 server of the
run (moto, WS_TEST_S3_ENDPOINT). The target's weights are named by --model-weights; the
draft's model is a local directory of config and tokenizer files with no weights of its own,
so its weights must come from the checkpoint URI (WEIGHTSTREAM_MODEL_URI or MX_MODEL_URI).
"""

import json
import os
import random
import shutil
import subprocess

import pytest
from conftest import CLI, requires_cli

ENDPOINT = os.environ.get("WS_TEST_S3_ENDPOINT")

pytestmark = [
    pytest.mark.skipif(not ENDPOINT, reason="WS_TEST_S3_ENDPOINT is not set: no S3 server for this run "
                                            "(scripts/test.sh starts moto_server)"),
    requires_cli,
]

boto3 = pytest.importorskip("boto3")


def command(*args, checkpoint_uri=None):
    """Runs the command with test credentials and, when given, the checkpoint URI variable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "WEIGHTSTREAM_")) and k != "MX_MODEL_URI"}
    env.update({"AWS_ENDPOINT_URL": ENDPOINT, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials"})
    if checkpoint_uri:
        env.update(checkpoint_uri)
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    local = tmp_path_factory.mktemp("draft") / "checkpoint"
    synth = command("synth", local, "--arch", "deepseek_v3", "--layers", 2, "--hidden", 64, "--shards", 4,
                    "--seed", 3)
    assert synth.returncode == 0, synth.stderr
    bucket = "draft-%d" % random.randrange(10**9)
    client = boto3.client("s3", endpoint_url=ENDPOINT, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    for path in sorted(local.iterdir()):
        client.upload_file(str(path), bucket, "model/" + path.name)
    snapshot = local.parent / "snapshot"
    snapshot.mkdir()
    shutil.copy(local / "config.json", snapshot / "config.json")
    (snapshot / "tokenizer.json").write_text('{"version": "1.0"}')
    (snapshot / "tokenizer_config.json").write_text('{"model_max_length": 4096}')

    config = json.loads((local / "config.json").read_text())
    mtp_prefix = "model.layers.%d." % config["num_hidden_layers"]
    index = json.loads((local / "model.safetensors.index.json").read_text())
    mtp_shards = sorted({shard for name, shard in index["weight_map"].items() if name.startswith(mtp_prefix)})
    return {"uri": "s3://%s/model" % bucket, "snapshot": str(snapshot), "mtp_shards": mtp_shards,
            "shards": len(set(index["weight_map"].values())), "bytes": index["metadata"]["total_size"]}


@pytest.mark.parametrize("variable", ["WEIGHTSTREAM_MODEL_URI", "MX_MODEL_URI"])
def test_target_and_draft_load_through_the_checkpoint_uri(model, variable):
    result = command("load", "--model", model["snapshot"], "--model-weights", model["uri"], "--speculative", "mtp",
                     "--json", "--no-progress", checkpoint_uri={variable: model["uri"]})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["target"]["source"] == model["uri"] and report["target"]["field"] == "model_weights"
    # The checkpoint URI is named by the variable that set it.
    assert report["draft"]["source"] == model["uri"] and report["draft"]["field"] == variable
    assert report["draft"]["passed_over"] == ["model_weights: not set",
                                              "model %s: no *.safetensors files" % model["snapshot"]]
    assert report["draft"]["shards_read"] == len(model["mtp_shards"])
    # Both modules from one stream: the checkpoint's bytes, read once.
    assert report["streams"] == 1 and report["bytes_read"] == model["bytes"]


@pytest.mark.parametrize("variable", ["WEIGHTSTREAM_MODEL_URI", "MX_MODEL_URI"])
def test_draft_only_reads_only_the_mtp_shards(model, variable):
    assert len(model["mtp_shards"]) < model["shards"]
    result = command("load", "--model", model["snapshot"], "--speculative", "mtp", "--draft-only", "--json",
                     "--no-progress", checkpoint_uri={variable: model["uri"]})
    assert result.returncode == 0, result.stderr
    draft = json.loads(result.stdout)["draft"]
    assert draft["shards_read"] == draft["shards_opened"] == len(model["mtp_shards"])
    resolved = json.loads(command("resolve", "--model", model["snapshot"], "--speculative", "mtp", "--json",
                                  checkpoint_uri={variable: model["uri"]}).stdout)
    assert resolved["draft"]["shards"] == model["mtp_shards"]


def test_without_the_checkpoint_uri_one_error_names_every_source(model):
    result = command("load", "--model", model["snapshot"], "--model-weights", model["uri"], "--speculative", "mtp",
                     "--no-progress")
    assert result.returncode == 1
    assert ("weightstream: error: Cannot find any safetensors model weights for the draft (mtp): "
            "model_weights: not set; model %s: no *.safetensors files; WEIGHTSTREAM_MODEL_URI: not set"
            % model["snapshot"]) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
