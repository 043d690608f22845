"""``--load-format weightstream``: vLLM's model loader interface (BaseModelLoader) over
weightstream's per-rank streaming into the model's own parameters."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Set

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from .._api import Checkpoint
from .._model import LoadSession
from ._model import (
    BOUND_QUANTIZATIONS,
    BoundModel,
    LoaderOptions,
    ModelSources,
    NoMappingTable,
    _first_names,
    bind_model,
    check_in_place,
    config_dict,
    first_weights_source,
    log_once,
    logger,
    parallel_ranks,
    resolve_module_source,
    route_checkpoint,
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
        if bound is None:
            config = config_dict(sources, model_config)
            try:
                quantization = getattr(model_config, "quantization", None)
                if quantization not in BOUND_QUANTIZATIONS:
                    raise NoMappingTable(f"quantization '{quantization}'")
                bound = bind_model(model, config, role, model_config.dtype, parallel_ranks(model))
            except NoMappingTable as reason:
                log_once(logging.WARNING, "weightstream: no layout for %s (%s): the %s loads through the model's "
                         "load_weights, fed by weightstream's streamer, at iterator speed",
                         type(model).__name__, reason, role)
                self._load_through_model(model, model_config, sources, role, started)
                return
            store_binding(model, bound)
        # A reload once a load finished; a load that failed before (no source, say) is retried cold.
        mode = "reload" if bound.layout.loads_finished else "cold"
        if mode == "reload":
            check_in_place(model, bound, through_load_weights=True)
        self._load_layout(model, model_config, sources, bound, mode, started)

    def _load_layout(self, model: torch.nn.Module, model_config: Any, sources: ModelSources, bound: BoundModel,
                     mode: str, started: float) -> None:
        method = speculative_method() if bound.role == "draft" else ""
        resolution = resolve_module_source(sources, bound.role, bound.layout, self.options, method)
        checkpoint = Checkpoint(resolution["uri"], **self.options.stream)
        by_load_weights = route_checkpoint(bound, checkpoint)
        session = LoadSession(bound.layout)
        session.begin(mode)
        stats = session.load_checkpoint(checkpoint)
        session.finish()
        loaded: Optional[Set[str]] = set(bound.filled_model_names)
        through_model = 0
        if by_load_weights:
            from_model = model.load_weights(checkpoint.stream(framework="torch", names=by_load_weights))
            through_model = len(by_load_weights)
            loaded = None if from_model is None else loaded | set(from_model)
        self.last_load = {"path": "layout", "mode": mode, "role": bound.role, "source": resolution["uri"],
                          "field": resolution["field"], "passed_over": resolution["passed_over"],
                          "layout": bound.description, "tensors_streamed": stats["tensors"],
                          "bytes_streamed": stats["bytes"], "bytes_read": stats["bytes_read"],
                          "shards_read": stats["shards_read"], "parameters_bound": len(bound.bound),
                          "parameters_through_load_weights": len(bound.unbound),
                          "tensors_through_load_weights": through_model,
                          "seconds": time.perf_counter() - started}
        through = ("nothing through load_weights" if not by_load_weights else
                   f"{through_model} checkpoint tensors through load_weights ({_first_names(by_load_weights)})")
        logger.info("weightstream: %s load of the %s (%s) from %s (%s): %d parameters bound in place, %d tensors, "
                    "%d bytes streamed into them (%d read), %s, %.2f s", mode, bound.role, bound.description,
                    resolution["uri"], resolution["field"], len(bound.bound), stats["tensors"], stats["bytes"],
                    stats["bytes_read"], through, self.last_load["seconds"])
        self._check_filled(model, model_config, loaded)

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
