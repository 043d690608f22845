"""``--load-format weightstream``: SGLang's DefaultModelLoader, its weights streamed by
weightstream straight into the model's own parameters.

SGLang builds the model (its ``load_model``, as for any load format) and runs its own
``process_weights_after_loading`` after; between the two, this rank's layout is bound to
the model's parameters and only this rank's byte ranges are read into them. Checkpoint
tensors the layout leaves to the model go through its ``load_weights``, and a model
weightstream has no table for loads entirely that way, fed by weightstream's streamer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import BaseModelLoader, DefaultModelLoader, post_load_weights

from .._api import Checkpoint
from .._engine.renames import engine_names
from .._engine import (
    BoundModel,
    CheckpointAhead,
    LoaderOptions,
    ModelTensors,
    NoMappingTable,
    Parallel,
    bind_layout,
    checkpoint_ahead,
    check_in_place,
    first_weights_source,
    load_from_peers_or_storage,
    load_layout,
    log_once,
    model_tensors,
    pulls_refused,
    record_load_metrics,
    resolve_module_source,
    serve_model,
    serving_peer,
    store_binding,
    stored_binding,
)
from . import logger

#: SGLang quantization methods a layout binds: none, and FP8 block-scaled checkpoints.
BOUND_QUANTIZATIONS = (None, "fp8")


def is_fused_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of SGLang's FusedMoE layers (a MoE layer's stacked experts)."""
    return hasattr(module, "moe_ep_size") and hasattr(module, "num_local_experts") and \
        hasattr(module, "w13_weight")


def parallel_ranks(model: Optional[torch.nn.Module] = None, walked: Optional[ModelTensors] = None) -> Parallel:
    """This process's tensor-parallel rank in SGLang, and its expert-parallel rank when the
    model's MoE layers divide their experts (--ep-size; ``walked``: the model's tensors when
    walked already, as bind_model has them). Raises NoMappingTable for an expert division
    weightstream's layout does not describe: experts cut both by expert and by tensor
    parallelism, or shared experts fused into the routed ones."""
    from sglang.srt.distributed.parallel_state import (  # noqa: PLC0415
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    parallel = Parallel(tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank())
    if walked is None and model is not None:
        walked = model_tensors(model, is_fused_experts)
    for experts in walked.experts if walked is not None else []:
        ep_size, ep_rank = int(experts.moe_ep_size), int(experts.moe_ep_rank)
        if ep_size == 1:
            return parallel
        if int(getattr(experts, "moe_tp_size", 1)) != 1:
            raise NoMappingTable(f"experts divided over {ep_size} expert-parallel ranks and cut over "
                                 f"{experts.moe_tp_size} tensor-parallel ranks; weightstream binds whole experts "
                                 f"(--ep-size equal to --tp-size)")
        parallel.ep_size, parallel.ep_rank = ep_size, ep_rank
        return parallel
    return parallel


#: The draft's parameters SGLang's EAGLE worker gives the target's tensors once the draft is
#: loaded (set_embed_and_head); its NextN load_weights skips the MTP layer's own copies.
DRAFT_FROM_TARGET = ("model.embed_tokens.weight", "lm_head.weight")


def world_rank() -> int:
    """This process's rank in SGLang's world group (its tp rank in a tp-only instance)."""
    from sglang.srt.distributed.parallel_state import get_world_group  # noqa: PLC0415

    return get_world_group().rank_in_group


def model_candidates(layout_name: str, role: str) -> List[str]:
    """SGLang's names for a layout parameter: the layout's own (fused qkv_proj, gate_up_proj,
    experts.w13_weight and w2_weight, as SGLang names them), but MLA's fused_qkv_a_proj and a
    draft's NextN modules (weightstream._engine.renames)."""
    return engine_names("sglang", layout_name, role)


def speculative_method(role: str) -> str:
    """SGLang's --speculative-algorithm (lower case) for a draft's messages; "" for a target."""
    if role != "draft":
        return ""
    from sglang.srt.runtime_context import get_spec  # noqa: PLC0415

    return str(get_spec().speculative_algorithm or "").lower()


def config_dict(model_config: Any) -> Dict[str, Any]:
    """The model's config.json, from its folder when it has one, else SGLang's parsed
    Hugging Face config."""
    path = os.path.join(str(model_config.model_path), "config.json")  # a Hub id: SGLang's parsed config
    if os.path.isfile(path):
        with open(path) as file:
            return json.load(file)
    return model_config.hf_config.to_dict()


def is_draft(model_config: Any) -> bool:
    """Whether SGLang is loading a speculative draft (its draft worker's ModelConfig)."""
    return bool(getattr(model_config, "is_draft_model", False))


def is_draft_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is one of SGLang's MTP draft classes (DeepseekV3ForCausalLMNextN,
    Glm4MoeForCausalLMNextN, Qwen3NextForCausalLMMTP, ...): SGLang names them so."""
    return type(model).__name__.endswith(("NextN", "MTP"))


def bind_model(model: torch.nn.Module, config: Dict[str, Any], quantization: Optional[str],
               dtype: torch.dtype, role: str = "target") -> BoundModel:
    """This rank's layout of ``config`` bound to the SGLang model's own parameters (in the
    dtype of its embedding, ``dtype`` when it has none): the target's, or with ``role``
    "draft" the MTP layer's, bound to SGLang's NextN draft module (whose embedding and lm_head
    are the target's). Raises NoMappingTable for a quantization, architecture or dtype
    weightstream has no table for."""
    if quantization not in BOUND_QUANTIZATIONS:
        raise NoMappingTable(f"quantization '{quantization}'")
    # One walk of the model's modules serves both (a walk of the bench's DeepSeek-V3 rank,
    # about 700 modules, costs 3 ms of bind_model's 19 ms on a busy 2-core VM).
    walked = model_tensors(model, is_fused_experts)
    # SGLang holds some routers in F32 (GLM-4.5's mlp.gate) where the checkpoint's are BF16.
    return bind_layout(walked, config, role, dtype, parallel_ranks(walked=walked),
                       model_candidates, "SGLang", logger, DRAFT_FROM_TARGET if role == "draft" else (),
                       wider_floats=True)


class WeightstreamModelLoader(DefaultModelLoader):
    """SGLang's DefaultModelLoader with weightstream in place of its weights iterator.

    For an architecture weightstream has a table for (BF16 or FP8 block-scaled; tensor and
    expert parallel), this rank's layout is bound to the model's own parameters and only
    this rank's byte ranges are streamed into them; what the layout does not cover goes
    through the model's ``load_weights``. SGLang builds the model and post-processes it
    (process_weights_after_loading) as for its own loader.
    """

    def __init__(self, load_config: Any) -> None:
        self.options = LoaderOptions.from_extra_config(getattr(load_config, "model_loader_extra_config", None))
        # DefaultModelLoader's methods (weights discovery, downloads) read the format: they
        # serve the SGLang default's, as LayeredModelLoader resets it.
        load_config.load_format = LoadFormat.AUTO
        # DefaultModelLoader.__init__ only checks the extra config's keys against the default
        # loader's own; weightstream's were checked above.
        BaseModelLoader.__init__(self, load_config)
        self._model_config: Optional[Any] = None
        #: What the last load did: "layout" or "load_weights", the source, counters.
        self.last_load: Dict[str, Any] = {}

    def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
        self._model_config = model_config
        return super().load_model(model_config=model_config, device_config=device_config)

    def load_weights_and_postprocess(self, model: torch.nn.Module, weights: Any, target_device: Any) -> None:
        """SGLang's load step (DefaultModelLoader.load_model calls it with its weights
        iterator, which is never read here): weightstream's load, then SGLang's post-processing."""
        if self._model_config is None:
            # SGLang's update_weights_from_disk makes a loader of the server's format and calls
            # this with its own weights iterator of the new path, without the model config:
            # the weights go through SGLang's load_weights, into the same (bound) parameters.
            DefaultModelLoader.load_weights_and_postprocess(model, weights, target_device)
            return
        del weights  # a generator that has read nothing
        self.load_weights(model, self._model_config)
        if not self.last_load.get("tensors_through_load_weights"):
            # The model's load_weights ends with its post-load fixup (DeepSeek's w_kc and w_vc
            # from kv_b_proj); a load that bypasses it runs it, as SGLang's own such loaders do.
            post_load_weights(model)
        DefaultModelLoader.postprocess_weights(model, target_device)

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        """Loads (or, for a model loaded before, reloads in place) the model's weights: from the
        serving peers of a peer:// model_uri first, else from the model's checkpoint; with
        ``serve``, each rank then serves its bound parameters (docs/PEERS.md)."""
        started = time.perf_counter()
        path = self._weights_folder(model_config)
        bound = stored_binding(model)
        # The checkpoint's headers are read while the model is bound (peers serve no headers).
        ahead = checkpoint_ahead(path, self.options)
        if bound is None:
            try:
                bound = bind_model(model, config_dict(model_config), getattr(model_config, "quantization", None),
                                   model_config.dtype, "draft" if is_draft(model_config) else "target")
            except NoMappingTable as reason:
                log_once(logger, logging.WARNING, "weightstream: no layout for %s (%s): it loads through the "
                         "model's load_weights, fed by weightstream's streamer, at iterator speed",
                         type(model).__name__, reason)
                if ahead is not None:
                    ahead.result()
                self._load_through_model(model, path, started)
                return
            store_binding(model, bound)
        mode = "reload" if bound.layout.loads_finished else "cold"
        if mode == "reload":
            check_in_place(model, bound, through_load_weights=True)
        serving = serving_peer(model) is not None

        def load_storage(options: LoaderOptions, peer_failure: str) -> Tuple[Checkpoint, Dict[str, Any]]:
            resolution = resolve_module_source(path, "", bound.role, bound.layout, options,
                                               speculative_method(bound.role), ahead)
            last_load, _ = load_layout(model, bound, resolution, mode, started, logger)
            if peer_failure:
                last_load["peer_failure"] = peer_failure
            return resolution["checkpoint"], last_load

        with pulls_refused(model):
            source, self.last_load = load_from_peers_or_storage(bound, mode, started, self.options, load_storage,
                                                                logger)
        if not serving and self.options.serve and bound.role == "target":  # peers serve targets
            self.last_load["serving"] = serve_model(model, bound, source, self.options, world_rank(), logger)
        record_load_metrics(model, self.options, self.last_load, world_rank(), logger)
        object.__setattr__(model, "_weightstream_last_load", self.last_load)  # SGLang keeps no loader

    def _weights_folder(self, model_config: Any) -> str:
        """Where the weights are: a URI or a local folder as it is; a Hub id through SGLang's
        own download (its cache, revision and patterns), as the folder it landed in."""
        path = str(model_config.model_path)
        if "://" in path or os.path.isdir(path):
            return path
        folder, _, _ = self._prepare_weights(path, model_config.revision, fall_back_to_pt=False)
        return folder

    def _load_through_model(self, model: torch.nn.Module, path: str, started: float) -> None:
        uri = first_weights_source(path, "", self.options)
        checkpoint = Checkpoint(uri, **self.options.stream)
        model.load_weights(checkpoint.stream(framework="torch"))
        self.last_load = {"path": "load_weights", "mode": "cold", "role": "target", "source": uri,
                          "tensors_through_load_weights": len(checkpoint), "seconds": time.perf_counter() - started}
        record_load_metrics(model, self.options, self.last_load, world_rank(), logger)
        object.__setattr__(model, "_weightstream_last_load", self.last_load)


__all__ = ["WeightstreamModelLoader", "bind_model", "is_draft", "is_draft_module", "parallel_ranks"]
