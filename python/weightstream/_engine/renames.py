"""How each engine names a layout's parameters, as data: one table per engine, in stages.

A layout names parameters as the checkpoint's architecture fuses them (``qkv_proj``,
``gate_up_proj``, ``experts.w13_weight``), and a draft's MTP layer as the checkpoint holds it
(``model.layers.{N}.*``, Qwen3-Next's ``mtp.*``). vLLM and SGLang mostly agree, but not
everywhere: where a draft's modules live, vLLM 0.33's RoutedExperts submodule, SGLang's name of
MLA's fused ``q_a_proj`` and ``kv_a_proj_with_mqa``. Each stage of an engine's table is a list
of rules tried in order; the first that applies renames the name (into one or more candidate
names, the likeliest first), and the next stage takes each candidate in turn. A name no rule
of a stage matches goes on unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple


@dataclass(frozen=True)
class Rename:
    """One rule: a name that fully matches ``pattern`` becomes ``names`` (``re`` templates:
    ``\\g<1>`` is the first group, ``\\g<0>`` the whole name), for a parameter of ``role``
    ("target" or "draft"; None: either) in a model of one of ``model_types`` (empty: any)."""

    pattern: re.Pattern
    names: Tuple[str, ...]
    role: Optional[str] = None
    model_types: FrozenSet[str] = frozenset()

    def applies(self, role: str, model_type: str) -> bool:
        return (self.role is None or self.role == role) and (not self.model_types or model_type in self.model_types)


def _rule(pattern: str, *names: str, role: Optional[str] = None, model_types: Iterable[str] = ()) -> Rename:
    return Rename(re.compile(pattern), tuple(names), role, frozenset(model_types))


#: Families whose MTP layer vLLM builds as DeepSeek's: its own enorm, hnorm, eh_proj and
#: shared_head, the decoder layer nested under mtp_block, the embedding the draft's own.
_DEEPSEEK_MTP = ("deepseek_v3", "deepseek_v2", "deepseek_mtp", "kimi_k2", "glm4_moe", "glm4_moe_mtp")

#: Every engine's stages, by name, in the order they apply.
RENAMES: Dict[str, Tuple[Tuple[str, Tuple[Rename, ...]], ...]] = {
    "vllm": (
        ("draft", (
            # Qwen3-Next's mtp.* lives under model.*.
            _rule(r"mtp\.(.*)", r"model.\g<1>", role="draft"),
            _rule(r"model\.layers\.\d+\.(embed_tokens\..*)", r"model.\g<1>", role="draft", model_types=_DEEPSEEK_MTP),
            _rule(r"model\.layers\.\d+\.(?:enorm|hnorm|eh_proj|shared_head)\..*", r"\g<0>", role="draft",
                  model_types=_DEEPSEEK_MTP),
            _rule(r"(model\.layers\.\d+)\.(.*)", r"\g<1>.mtp_block.\g<2>", role="draft", model_types=_DEEPSEEK_MTP),
        )),
        # vLLM 0.33's FusedMoE keeps its stacked expert weights (and their scales) in a
        # RoutedExperts submodule: X.experts.routed_experts.w13_weight where the layout says
        # X.experts.w13_weight (older vLLM: the layout's name).
        ("experts", (
            _rule(r"(.*\.experts)\.(w13_weight|w2_weight)(.*)", r"\g<1>.routed_experts.\g<2>\g<3>", r"\g<0>"),
        )),
    ),
    "sglang": (
        # SGLang's NextN draft: the MTP layer's own norms, eh_proj and embedding under model.*
        # (its DeepSeek weight loader's nextn_spec_weight_names), its decoder layer under
        # model.decoder.*, its shared head's projection the draft's lm_head.
        ("draft", (
            _rule(r"model\.layers\.\d+\.shared_head\.head\.(.*)", r"lm_head.\g<1>", role="draft"),
            _rule(r"model\.layers\.\d+\.((?:enorm|hnorm|eh_proj|shared_head\.norm|embed_tokens)\..*)", r"model.\g<1>",
                  role="draft"),
            _rule(r"model\.layers\.\d+\.(.*)", r"model.decoder.\g<1>", role="draft"),
        )),
        # MLA's q_a_proj and kv_a_proj_with_mqa, fused: SGLang's name for the fusion.
        ("fused", (
            _rule(r"(.*)self_attn\.fused_qkv_a_proj\.(.*)", r"\g<1>self_attn.fused_qkv_a_proj_with_mqa.\g<2>"),
        )),
    ),
}


def _apply(stage: Tuple[Rename, ...], name: str, role: str, model_type: str) -> List[str]:
    for rule in stage:
        if rule.applies(role, model_type):
            match = rule.pattern.fullmatch(name)
            if match:
                return [match.expand(template) for template in rule.names]
    return [name]


def engine_names(engine: str, layout_name: str, role: str = "target", model_type: str = "",
                 stages: Optional[Iterable[str]] = None) -> List[str]:
    """The names ``engine`` ("vllm" or "sglang") may give a layout parameter, the likeliest
    first, through every stage of its table (or only those ``stages`` names)."""
    wanted = None if stages is None else set(stages)
    names = [layout_name]
    for stage_name, stage in RENAMES[engine]:
        if wanted is None or stage_name in wanted:
            names = [renamed for name in names for renamed in _apply(stage, name, role, model_type)]
    return list(dict.fromkeys(names))
