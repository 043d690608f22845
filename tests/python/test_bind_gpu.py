"""Engines own the memory, on a GPU (issue 17; run by the python stage of scripts/gpu.sh).

- bind_module on a torch module whose CUDA parameters have the layout's names and shapes: a
  cold load, a reload and an update pushed over CUDA IPC all land in the module's tensors,
  byte for byte what `weightstream export` writes for the same checkpoint, with data_ptr()
  unchanged throughout; a CUDA graph captured before the reload reads the new values after it.
- transformers: a fresh LlamaForCausalLM, and a Qwen3MoeForCausalLM (its fused experts bound as
  views), bound through the identity layout (one parameter per checkpoint tensor) and loaded by
  weightstream give the logits of from_pretrained.

Skips without torch, a CUDA device, a CUDA build of weightstream, or transformers.
"""
import subprocess
import threading

import pytest
from conftest import CLI, requires_cli

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
weightstream = pytest.importorskip("weightstream")

pytestmark = [
    requires_cli,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for torch"),
    pytest.mark.skipif(not weightstream.cuda_compiled() or weightstream.cuda_device_count() == 0,
                       reason="needs a CUDA build of weightstream and a GPU"),
]

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def synth(directory, seed):
    subprocess.run([CLI, "synth", str(directory), "--arch", "llama", "--layers", "2", "--seed", str(seed)],
                   check=True, capture_output=True)
    return weightstream.open(str(directory))


def exported(checkpoint, out):
    """Bytes of every parameter as `weightstream export` writes them (tp 1)."""
    subprocess.run([CLI, "export", checkpoint.uri, str(out)], check=True, capture_output=True)
    return {name: np.ascontiguousarray(array).tobytes()
            for name, array in weightstream.load(str(out), framework="numpy").items()}


def module_like(layout, device):
    """A torch module whose parameters have the layout's names, dtypes and shapes, on `device`,
    filled with junk (as an engine builds its model before loading weights)."""
    root = torch.nn.Module()
    for name in layout.parameter_names:
        info = layout.parameter_info(name)
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, torch.nn.Module())
            node = node._modules[part]
        data = torch.full(info["shape"], 0.125, dtype=TORCH_DTYPES[info["dtype"]], device=device)
        node.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
    return root


def module_bytes(module):
    return {name: parameter.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
            for name, parameter in module.named_parameters()}


def test_bound_torch_module_on_the_gpu_receives_cold_load_reload_and_cuda_ipc_update_in_place(tmp_path):
    first = synth(tmp_path / "first", 1)
    second = synth(tmp_path / "second", 2)
    expected_first = exported(first, tmp_path / "first.safetensors")
    expected_second = exported(second, tmp_path / "second.safetensors")
    layout = weightstream.model_layout(first, device="cuda:0")
    model = module_like(layout, "cuda:0")
    assert sorted(layout.bind_module(model)) == sorted(layout.parameter_names)
    assert layout.unbound_names == []
    pointers = {name: parameter.data_ptr() for name, parameter in model.named_parameters()}
    hook_runs = []
    layout.add_hook("count", lambda: hook_runs.append(layout.loads_finished))

    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(first)
    session.finish()
    assert module_bytes(model) == expected_first
    assert layout.allocated_bytes == 0

    # A CUDA graph captured now reads the parameter's address: after the reload it must see
    # the new values, which it does only if the reload wrote in place.
    watched = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    seen = torch.empty_like(watched)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        seen.copy_(watched)  # warm-up outside the capture, as torch asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen.copy_(watched)

    session.begin("reload")
    session.load_checkpoint(second)
    session.finish()
    assert module_bytes(model) == expected_second
    assert {name: parameter.data_ptr() for name, parameter in model.named_parameters()} == pointers
    graph.replay()
    torch.cuda.synchronize()
    assert seen.view(torch.uint8).cpu().numpy().tobytes() == expected_second["model.layers.1.mlp.down_proj.weight"]

    # A trainer pushes the first checkpoint back over CUDA IPC. CUDA IPC joins two processes
    # (a process cannot open its own handles), so the trainer is `weightstream send`.
    receiver = weightstream.UpdateReceiver(layout, transport="cuda-ipc", token="t0ken", device="cuda:0")
    reports = []
    thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=60.0)))
    thread.start()
    sent = subprocess.run([CLI, "send", first.uri, "--to", receiver.address, "--via", "cuda-ipc", "--bucket-size", "1MiB",
                           "--device", "cuda:0", "--token-stdin"], input="t0ken\n", capture_output=True, text=True,
                          timeout=120)
    assert sent.returncode == 0, sent.stderr
    thread.join(timeout=60)
    assert not thread.is_alive() and reports
    assert module_bytes(model) == expected_first
    assert {name: parameter.data_ptr() for name, parameter in model.named_parameters()} == pointers
    graph.replay()
    torch.cuda.synchronize()
    assert seen.view(torch.uint8).cpu().numpy().tobytes() == expected_first["model.layers.1.mlp.down_proj.weight"]
    assert hook_runs == [0, 1, 2], "the model hook runs once per load, reload and update"


def test_bind_refuses_a_cuda_tensor_for_a_host_layout_and_a_non_contiguous_one(tmp_path):
    checkpoint = synth(tmp_path / "c", 3)
    layout = weightstream.model_layout(checkpoint, device="cpu")
    name = "model.layers.0.mlp.down_proj.weight"
    info = layout.parameter_info(name)
    on_gpu = torch.zeros(info["shape"], dtype=TORCH_DTYPES[info["dtype"]], device="cuda:0")
    with pytest.raises(weightstream.Error, match=f"cannot bind parameter {name} .*expected memory on cpu .*given "
                                                 "memory on cuda:0"):
        layout.bind(name, on_gpu)
    layout = weightstream.model_layout(checkpoint, device="cuda:0")
    transposed = torch.zeros(list(reversed(info["shape"])), dtype=TORCH_DTYPES[info["dtype"]], device="cuda:0").T
    with pytest.raises(weightstream.Error, match="expected a contiguous"):
        layout.bind(name, transposed)


def test_transformers_llama_bound_through_the_identity_layout_gives_from_pretrained_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    identity_layout = getattr(weightstream, "identity_layout", None)
    if identity_layout is None:
        pytest.skip("needs weightstream.identity_layout (issue 11), not in this build")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")  # safetensors
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama", attn_implementation="eager")
    reference = reference.to("cuda:0").eval()

    torch.manual_seed(1)  # other random weights: the load must replace every one of them
    fresh = transformers.LlamaForCausalLM(config).to(device="cuda:0", dtype=reference.dtype).eval()
    pointers = {name: parameter.data_ptr() for name, parameter in fresh.named_parameters()}
    checkpoint = weightstream.open(str(tmp_path / "llama"))
    layout = identity_layout(checkpoint)
    bound = layout.bind_module(fresh)
    assert sorted(bound) == sorted(checkpoint.names)
    assert layout.unbound_names == []

    tokens = torch.tensor([[1, 17, 42, 99, 3, 250, 7, 64]], device="cuda:0")
    with torch.no_grad():
        expected = reference(tokens).logits
        assert not torch.equal(fresh(tokens).logits, expected)
        session = weightstream.LoadSession(layout)
        session.begin("cold")
        session.load_checkpoint(checkpoint)
        session.finish()
        torch.testing.assert_close(fresh(tokens).logits, expected, rtol=0, atol=0)
    assert {name: parameter.data_ptr() for name, parameter in fresh.named_parameters()} == pointers


def bind_transformers_moe(layout, model):
    """Binds the identity layout of a transformers Qwen3-MoE checkpoint to the model's own
    tensors. transformers 5 holds each layer's experts fused (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) where the checkpoint has one tensor per expert and
    projection; each of those is a contiguous slice of the fused tensor, bound as a view."""
    tensors = dict(model.named_parameters())
    bound = []
    for name in layout.parameter_names:
        prefix, marker, rest = name.partition(".mlp.experts.")
        if marker:
            expert, projection, _ = rest.split(".")
            if projection == "down_proj":
                view = tensors[f"{prefix}.mlp.experts.down_proj"][int(expert)]
            else:
                fused = tensors[f"{prefix}.mlp.experts.gate_up_proj"][int(expert)]
                half = fused.shape[0] // 2
                view = fused[:half] if projection == "gate_proj" else fused[half:]
            layout.bind(name, view.detach())
        else:
            layout.bind(name, tensors[name].detach())
        bound.append(name)
    return bound


def test_transformers_qwen3_moe_bound_through_the_identity_layout_gives_from_pretrained_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                         moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                         max_position_embeddings=128, tie_word_embeddings=False,
                                         attn_implementation="eager")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "qwen3_moe")
    reference = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "qwen3_moe", attn_implementation="eager")
    reference = reference.to("cuda:0").eval()

    torch.manual_seed(1)  # other random weights: the load must replace every one of them
    fresh = transformers.Qwen3MoeForCausalLM(config).to(device="cuda:0", dtype=reference.dtype).eval()
    pointers = {name: parameter.data_ptr() for name, parameter in fresh.named_parameters()}
    checkpoint = weightstream.open(str(tmp_path / "qwen3_moe"))
    assert any(".mlp.experts.3.up_proj.weight" in name for name in checkpoint.names)
    layout = weightstream.identity_layout(checkpoint)
    assert sorted(bind_transformers_moe(layout, fresh)) == sorted(checkpoint.names)
    assert layout.unbound_names == []

    tokens = torch.tensor([[1, 17, 42, 99, 3, 250, 7, 64]], device="cuda:0")
    with torch.no_grad():
        expected = reference(tokens).logits
        assert not torch.allclose(fresh(tokens).logits, expected)
        session = weightstream.LoadSession(layout)
        session.begin("cold")
        session.load_checkpoint(checkpoint)
        session.finish()
        for name, parameter in reference.named_parameters():
            assert torch.equal(dict(fresh.named_parameters())[name], parameter), name
        # Equal weights; the experts' sums go through index_add_ (atomics on a GPU), so the
        # logits agree to rounding rather than bit for bit.
        torch.testing.assert_close(fresh(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    assert {name: parameter.data_ptr() for name, parameter in fresh.named_parameters()} == pointers
    assert layout.allocated_bytes == 0
