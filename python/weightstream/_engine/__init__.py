"""What every engine plugin (weightstream.vllm, weightstream.sglang) shares: weightstream's
options from ``--model-loader-extra-config``, an engine model's parameters bound to this
rank's ModelLayout (its own tensors, written in place, never a shadow copy), where a
module's weights are, and one load of the bound layout from a checkpoint or from peers.

The engine plugins say only what differs between engines: how their parameters are named,
where they keep their parallel ranks, and which of their modules hold stacked experts.
Imports torch, never an engine. One module per concern: ``options`` (the extra config),
``naming``, ``binding`` (the model's tensors to the layout), ``sources`` (where a module's
weights are, the checkpoint opened ahead), ``loading`` (one load, with the library's fallback
behind peers) and ``serving`` (serving peers, metrics).
"""

from .options import (  # noqa: F401 - the plugins import them from here
    STREAM_OPTIONS,
    EXTRA_CONFIG_KEYS,
    log_once,
    LoaderOptions,
    serve_address,
)
from .naming import (  # noqa: F401 - the plugins import them from here
    _TORCH_DTYPES,
    safetensors_dtype,
    device_name,
    first_names,
)
from .binding import (  # noqa: F401 - the plugins import them from here
    BY_LOAD_WEIGHTS,
    NoMappingTable,
    Parallel,
    BoundModel,
    ModelTensors,
    model_tensors,
    Candidates,
    parameter_dtype,
    bind_layout,
    check_in_place,
    route_checkpoint,
    stored_binding,
    store_binding,
)
from .sources import (  # noqa: F401 - the plugins import them from here
    is_hub_id,
    CheckpointAhead,
    resolve_module_source,
    first_weights_source,
    names_peers,
    checkpoint_ahead,
)
from .loading import (  # noqa: F401 - the plugins import them from here
    load_layout,
    pull_layout,
    StorageLoad,
    load_from_peers_or_storage,
)
from .serving import (  # noqa: F401 - the plugins import them from here
    serving_peer,
    metrics_endpoint,
    record_load_metrics,
    model_metrics,
    pulls_refused,
    serve_model,
)
