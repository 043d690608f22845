"""``--load-format weightstream``: vLLM's model loader interface (BaseModelLoader) over
weightstream's per-rank streaming into the model's own parameters."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Set, Tuple

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from .._api import Checkpoint
from .._engine import (checkpoint_ahead, load_from_peers_or_storage, load_layout, pulls_refused, record_load_metrics,
                       serve_model)
from ._model import (
    BOUND_QUANTIZATIONS,
    BoundModel,
    CheckpointAhead,
    LoaderOptions,
    ModelSources,
    NoMappingTable,
    bind_model,
    check_in_place,
    config_dict,
    first_weights_source,
    log_once,
    logger,
    resolve_module_source,
    serving_peer,
    store_binding,
    stored_binding,
)

def is_draft(model_config: Any) -> bool:
    """Whether vLLM is loading the speculative draft (its draft_model_config) rather than
    the target."""
    from vllm.config import get_current_vllm_config  # noqa: PLC0415

    speculative = getattr(get_current_vllm_config(), "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None) if speculative is not None else None
    if draft is not None and model_config is draft:
        return True
    model_type = str(getattr(getattr(model_config, "hf_config", None), "model_type", ""))
    return model_type.endswith("_mtp")


def speculative_method() -> str:
    from vllm.config import get_current_vllm_config  # noqa: PLC0415

    speculative = getattr(get_current_vllm_config(), "speculative_config", None)
    return str(getattr(speculative, "method", "") or "") if speculative is not None else ""


def world_rank() -> int:
    """This process's rank in vLLM's world group (its tp rank in a tp-only instance)."""
    from vllm.distributed import parallel_state  # noqa: PLC0415

    return parallel_state.get_world_group().rank if parallel_state._WORLD is not None else 0


class WeightstreamModelLoader(BaseModelLoader):
    """Loads a model's safetensors weights with weightstream.

    For an architecture weightstream has a table for (llama, qwen3, qwen3_moe, mixtral,
    deepseek_v3, kimi_k2, glm4_moe, qwen3_next; BF16 or FP8 block-scaled; tensor and expert
    parallel), this rank's layout is bound to the model's own parameters and only this
    rank's byte ranges are streamed into them, from a local folder or s3://; checkpoint
    tensors the layout does not cover go through the model's ``load_weights``. Other
    architectures load entirely through ``load_weights``, fed by weightstream's streamer.
    A load into a model loaded before is a reload, in place. ``process_weights_after_loading``
    is left to vLLM.

    Peers (docs/PEERS.md): with ``model_uri`` a ``peer://`` URI the target's bound layout is
    pulled from serving instances first (the model's own sources are the fallback); with
    ``serve`` "HOST:PORT" each rank serves its bound layout after its load, at PORT + its
    rank, for as long as the model lives.
    """

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.options = LoaderOptions.from_extra_config(getattr(load_config, "model_loader_extra_config", None))
        #: What the last load_weights did: "layout" or "load_weights", the source, counters.
        self.last_load: Dict[str, Any] = {}

    def download_model(self, model_config: Any) -> None:
        # A Hub id is fetched through vLLM's download; local paths and s3:// are read in place.
        ModelSources.of(model_config, self.load_config)

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        started = time.perf_counter()
        sources = ModelSources.of(model_config, self.load_config)
        role = "draft" if is_draft(model_config) else "target"
        bound = stored_binding(model)
        # The checkpoint's headers are read while the model is bound (peers serve no headers).
        ahead = checkpoint_ahead(sources.model_weights or sources.model, self.options)
        if bound is None:
            config = config_dict(sources, model_config)
            try:
                quantization = getattr(model_config, "quantization", None)
                if quantization not in BOUND_QUANTIZATIONS:
                    raise NoMappingTable(f"quantization '{quantization}'")
                bound = bind_model(model, config, role, model_config.dtype)
            except NoMappingTable as reason:
                log_once(logging.WARNING, "weightstream: no layout for %s (%s): the %s loads through the model's "
                         "load_weights, fed by weightstream's streamer, at iterator speed",
                         type(model).__name__, reason, role)
                self._load_through_model(model, model_config, sources, role, started)
                record_load_metrics(model, self.options, self.last_load, world_rank(), logger)
                return
            store_binding(model, bound)
        # A reload once a load finished; a load that failed before (no source, say) is retried cold.
        mode = "reload" if bound.layout.loads_finished else "cold"
        if mode == "reload":
            check_in_place(model, bound, through_load_weights=True)
        serving = serving_peer(model) is not None

        def load_storage(options: LoaderOptions, peer_failure: str) -> Tuple[Checkpoint, Dict[str, Any]]:
            return self._load_layout(model, model_config, sources, bound, mode, started, options, peer_failure,
                                     ahead)

        with pulls_refused(model):
            source, self.last_load = load_from_peers_or_storage(bound, mode, started, self.options, load_storage,
                                                                logger)
        if isinstance(source, str):  # pulled from peers
            self._check_filled(model, model_config, set(bound.filled_model_names))
        if not serving and self.options.serve and bound.role == "target":
            self.last_load["serving"] = serve_model(model, bound, source, self.options, world_rank(), logger)
        record_load_metrics(model, self.options, self.last_load, world_rank(), logger)

    def _load_layout(self, model: torch.nn.Module, model_config: Any, sources: ModelSources, bound: BoundModel,
                     mode: str, started: float, options: LoaderOptions, peer_failure: str = "",
                     ahead: Optional[CheckpointAhead] = None) -> Tuple[Checkpoint, Dict[str, Any]]:
        method = speculative_method() if bound.role == "draft" else ""
        resolution = resolve_module_source(sources, bound.role, bound.layout, options, method, ahead)
        last_load, loaded = load_layout(model, bound, resolution, mode, started, logger)
        if peer_failure:
            last_load["peer_failure"] = peer_failure
        self.last_load = last_load
        self._check_filled(model, model_config, loaded)
        return resolution["checkpoint"], last_load

    def _load_through_model(self, model: torch.nn.Module, model_config: Any, sources: ModelSources, role: str,
                            started: float) -> None:
        uri = first_weights_source(sources, self.options)
        checkpoint = Checkpoint(uri, **self.options.stream)
        loaded = model.load_weights(checkpoint.stream(framework="torch"))
        self.last_load = {"path": "load_weights", "mode": "cold", "role": role, "source": uri,
                          "tensors_through_load_weights": len(checkpoint), "seconds": time.perf_counter() - started}
        self._check_filled(model, model_config, None if loaded is None else set(loaded))

    def _check_filled(self, model: torch.nn.Module, model_config: Any, loaded: Optional[Set[str]]) -> None:
        """vLLM's default loader's check (track_weights_loading, with its exemptions for
        quantization scales): every parameter was filled. Skipped, as vLLM skips it, for a
        quantized model or a load_weights that reports nothing."""
        if loaded is None or getattr(model_config, "quantization", None) is not None:
            return
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: PLC0415

        DefaultModelLoader.track_weights_loading(self, model, loaded)
