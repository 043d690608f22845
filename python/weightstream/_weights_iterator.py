"""A drop-in for vLLM's ``safetensors_weights_iterator``, backed by weightstream."""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, List, Optional, Tuple, Union

from ._api import Checkpoint
from ._tensors import require_torch


def _sources(hf_weights_files: Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]]) -> List[str]:
    if isinstance(hf_weights_files, (str, os.PathLike)):
        return [os.fspath(hf_weights_files)]
    sources = [os.fspath(path) for path in hf_weights_files]
    if not sources:
        raise ValueError("safetensors_weights_iterator: no weight files given")
    return sources


def safetensors_weights_iterator(
    hf_weights_files: Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]],
    use_tqdm_on_load: bool = False,
    safetensors_load_strategy: Optional[str] = None,
    *,
    device: str = "cpu",
    **options: Any,
) -> Iterator[Tuple[str, Any]]:
    """Yields ``(name, torch.Tensor)`` for every tensor of ``hf_weights_files``, with the
    signature of vLLM's ``vllm.model_executor.model_loader.weight_utils.
    safetensors_weights_iterator``, so a loader can swap one for the other.

    ``hf_weights_files`` is a list of .safetensors files, streamed one after another in
    the order given (vLLM sorts them before the call), or a single URI: a file, a
    directory of shards, s3://bucket/prefix, gs://bucket/prefix or az://account/container/prefix. Tensors come in file order, each with its own
    memory on ``device`` ("cpu", as vLLM's iterator yields, or "cuda:N" to land them on the
    GPU directly), at most memory_limit bytes read ahead of the consumer.

    ``use_tqdm_on_load`` shows a progress bar over the files when tqdm is installed.
    ``safetensors_load_strategy`` is accepted for compatibility and ignored: weightstream
    always streams with ranged reads. Other keyword arguments are weightstream's options
    (concurrency, memory_limit, chunk_size, io, gpu_path). Needs torch; raises ImportError
    without it and weightstream.Error on a missing or malformed file.
    """
    require_torch("safetensors_weights_iterator yields torch tensors (as vLLM's does) and so")
    sources = _sources(hf_weights_files)
    if use_tqdm_on_load:
        try:
            from tqdm.auto import tqdm  # noqa: PLC0415 - optional
        except ImportError:
            pass
        else:
            sources = tqdm(sources, desc="Loading safetensors checkpoint shards (weightstream)")
    for source in sources:
        checkpoint = Checkpoint(source, **options)
        with checkpoint.stream(device=device, framework="torch") as tensors:
            yield from tensors
