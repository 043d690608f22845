"""weightstream as a vLLM model loader: ``vllm serve MODEL --load-format weightstream``.

This registers a loader with vLLM's model-loader registry
(``vllm.model_executor.model_loader.register_model_loader``, vLLM 0.10 and later, where
``BaseModelLoader`` has ``download_model`` and ``load_weights``). The loader feeds the
model's own ``load_weights`` from ``weightstream.safetensors_weights_iterator`` instead of
vLLM's ``safetensors_weights_iterator``, so checkpoints stream from local disks or
``s3://bucket/prefix`` in bounded memory, optionally straight onto the GPU.

It cannot run in weightstream's CI: that needs vLLM, torch and a GPU, none of which are
installed there. Importing this file without vLLM is harmless; ``register()`` then returns
False. To use it, make vLLM import it in every worker process, for example through a
general plugin in your own package's pyproject.toml::

    [project.entry-points."vllm.general_plugins"]
    weightstream = "vllm_loader_plugin:register"

then::

    vllm serve /models/Llama-3.1-8B --load-format weightstream \\
        --model-loader-extra-config '{"memory_limit": "2GiB", "device": "cuda"}'

``--model-loader-extra-config`` takes weightstream's options (concurrency, memory_limit,
chunk_size, io, gpu_path) and ``device``: "cpu" (default, as vLLM's own iterator) or
"cuda" (tensors land on this worker's GPU and the model's weight loaders copy
device to device).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, List, Union

import weightstream

try:
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
except ImportError:  # vLLM (or torch) is not installed: nothing to register.
    BaseModelLoader = None

LOAD_FORMAT = "weightstream"
_INDEX_FILE = "model.safetensors.index.json"


def checkpoint_source(model: str) -> Union[str, List[str]]:
    """What to stream for vLLM's ``--model`` value: for a local directory, its shard files
    (those the index names when there is one, so stray consolidated files are not read
    twice); an s3:// prefix or a single file as it is."""
    if not os.path.isdir(model):
        return model
    index = os.path.join(model, _INDEX_FILE)
    if os.path.exists(index):
        with open(index) as file:
            shards = sorted(set(json.load(file)["weight_map"].values()))
        return [os.path.join(model, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model}")
    return files


def stream_options(extra_config: Dict[str, Any]) -> Dict[str, Any]:
    """weightstream options and the device from ``--model-loader-extra-config``."""
    options = dict(extra_config or {})
    device = options.pop("device", "cpu")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    options["device"] = device
    return options


if BaseModelLoader is not None:

    class WeightstreamModelLoader(BaseModelLoader):
        """Loads safetensors weights through weightstream's bounded streamer."""

        def download_model(self, model_config) -> None:
            # weightstream reads local paths and s3:// URIs in place: nothing to fetch first.
            pass

        def load_weights(self, model: "torch.nn.Module", model_config) -> None:
            source = checkpoint_source(model_config.model)
            options = stream_options(self.load_config.model_loader_extra_config)
            weights = weightstream.safetensors_weights_iterator(source, use_tqdm_on_load=self.load_config.use_tqdm_on_load,
                                                                **options)
            loaded = model.load_weights(weights)
            # As vLLM's default loader does: a checkpoint that leaves a parameter unset is an
            # error, not a model serving random weights. Quantized models create parameters
            # the checkpoint does not name, so they are left to their own checks.
            if loaded is not None and model_config.quantization is None:
                missing = {name for name, _ in model.named_parameters()} - set(loaded)
                if missing:
                    raise ValueError(f"weights not initialized from {model_config.model}: {sorted(missing)}")


def register() -> bool:
    """Registers the loader under ``--load-format weightstream``; False without vLLM."""
    if BaseModelLoader is None:
        return False
    register_model_loader(LOAD_FORMAT)(WeightstreamModelLoader)
    return True


if __name__ == "__main__":
    print("registered" if register() else "vLLM is not installed: nothing registered")
