"""``--load-format weightstream``: vLLM's model loader interface (BaseModelLoader) over
weightstream's per-rank streaming into the model's own parameters."""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any, Dict, Optional, Set, Union

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from .. import _core
from .._api import Checkpoint
from .._engine import load_layout, pull_layout
from .._model import serve
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
    serve_address,
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
        ahead = None if self.options.model_uri.startswith("peer://") else \
            CheckpointAhead(sources.model_weights or sources.model, self.options)
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
                return
            store_binding(model, bound)
        # A reload once a load finished; a load that failed before (no source, say) is retried cold.
        mode = "reload" if bound.layout.loads_finished else "cold"
        if mode == "reload":
            check_in_place(model, bound, through_load_weights=True)
        server = serving_peer(model)
        if server is not None:
            server.begin_update()  # pullers that overlap the reload are refused
        try:
            source = self._load_from_peers_or_storage(model, model_config, sources, bound, mode, started, ahead)
        finally:
            if server is not None:
                server.end_update()  # rehashed, a new version
        if server is None and self.options.serve and bound.role == "target":
            self._serve(model, bound, source)

    def _load_from_peers_or_storage(self, model: torch.nn.Module, model_config: Any, sources: ModelSources,
                                    bound: BoundModel, mode: str, started: float,
                                    ahead: Optional[CheckpointAhead] = None) -> Union[str, Checkpoint]:
        """Peers first when model_uri is a peer:// URI (the target only), then the model's own
        sources; returns what the layout was loaded from (for its server)."""
        uri = self.options.model_uri
        if not uri.startswith("peer://"):
            return self._load_layout(model, model_config, sources, bound, mode, started, self.options, ahead=ahead)
        storage = dataclasses.replace(self.options, model_uri="")  # peers serve targets: a draft loads from storage
        if bound.role != "target":
            return self._load_layout(model, model_config, sources, bound, mode, started, storage)
        try:
            self._pull_layout(model, model_config, bound, mode, started, uri)
            return uri
        except _core.Error as error:
            failure = str(error)
        logger.warning("weightstream: cannot load %s from %s (%s); loading it from the model's own sources",
                       bound.description, uri, failure)
        try:
            return self._load_layout(model, model_config, sources, bound, mode, started, storage, failure)
        except (_core.Error, FileNotFoundError) as error:
            raise _core.Error(f"cannot load {bound.description} from any source: {uri}: {failure}; "
                              f"the model's own sources: {error}") from error

    def _pull_layout(self, model: torch.nn.Module, model_config: Any, bound: BoundModel, mode: str, started: float,
                     uri: str) -> None:
        """Pulls the bound layout from the serving peers of ``uri``, straight into the model's
        parameters where the layouts agree."""
        self.last_load = pull_layout(bound, uri, self.options, mode, started, logger)
        self._check_filled(model, model_config, set(bound.filled_model_names))

    def _serve(self, model: torch.nn.Module, bound: BoundModel, source: Union[str, Checkpoint]) -> None:
        """Serves the bound layout (extra-config ``serve``) while the model lives: the server
        closes when the model is collected or at the interpreter's exit, whichever is first."""
        address = serve_address(self.options.serve, world_rank())
        # A layout pulled from peers serves what they serve: the same digest is pinned again.
        pinned = self.options.peer_expect_digest if isinstance(source, str) else None
        server = serve(bound.layout, source, listen=address, token=self.options.peer_token,
                       timeout=self.options.peer_timeout, expect_digest=pinned)
        object.__setattr__(model, "_weightstream_server", server)
        weakref.finalize(model, server.close)
        self.last_load["serving"] = server.address
        logger.info("weightstream: serving %s at peer://%s", bound.description, server.address)

    def _load_layout(self, model: torch.nn.Module, model_config: Any, sources: ModelSources, bound: BoundModel,
                     mode: str, started: float, options: LoaderOptions, peer_failure: str = "",
                     ahead: Optional[CheckpointAhead] = None) -> Checkpoint:
        method = speculative_method() if bound.role == "draft" else ""
        resolution = resolve_module_source(sources, bound.role, bound.layout, options, method, ahead)
        self.last_load, loaded = load_layout(model, bound, resolution, mode, started, logger)
        if peer_failure:
            self.last_load["peer_failure"] = peer_failure
        self._check_filled(model, model_config, loaded)
        return resolution["checkpoint"]

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
