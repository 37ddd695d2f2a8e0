"""``gqa``: fewer KV heads by pooling K/V projections per group (Ainslie et al. 2023).

Shrinks the KV cache by ``H_kv / G`` at the cost of accuracy, which an optional short heal
recovers partly. The result stays a normal Llama-family HF model with a smaller
``num_key_value_heads``, so it saves, reloads with ``from_pretrained`` and exports unchanged.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field
from torch import nn

from optimize.finetune import FinetuneConfig, finetune
from optimize.rewrites.gqa import config_problem, convert_to_gqa
from optimize.stage_api import StageConfig, StageContext, register_stage


class GQAConfig(StageConfig):
    kind: Literal["gqa"] = "gqa"
    num_key_value_heads: int = Field(
        ..., gt=0, description="KV heads after the rewrite (G); must divide the current count; 1 gives MQA"
    )
    init: Literal["mean", "first", "random"] = Field(
        "mean", description="new KV head from its group: mean-pool (paper), first head, or random (ablations)"
    )
    heal: FinetuneConfig | None = Field(None, description="short distillation/fine-tune after the rewrite")

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        why = config_problem(config, self.num_key_value_heads)
        return [why] if why else []

    def planned_config(self, config: Any) -> Any:
        """The same config with ``num_key_value_heads`` KV heads (what the rewrite writes)."""
        if config_problem(config, self.num_key_value_heads):
            return config
        config = copy.deepcopy(config)
        config.num_key_value_heads = self.num_key_value_heads
        if hasattr(config, "get_text_config"):
            config.get_text_config().num_key_value_heads = self.num_key_value_heads
        return config


@register_stage("gqa", GQAConfig)
def gqa(model: nn.Module, cfg: GQAConfig, ctx: StageContext) -> nn.Module:
    """Grouped-query attention: pool K/V heads down to num_key_value_heads (mean/first/random), optional heal."""
    teacher = None
    if cfg.heal is not None and cfg.heal.loss == "distill":
        teacher = copy.deepcopy(model).eval()  # the pre-rewrite model, before any weight changes
    before, after = convert_to_gqa(model, cfg.num_key_value_heads, cfg.init, seed=ctx.seed)
    facts = {
        "kv_heads_before": before.kv_heads,
        "kv_heads_after": after.kv_heads,
        "query_heads": before.heads,
        "head_dim": before.head_dim,
        "init": cfg.init,
        "kv_cache_bytes_per_token_before": before.kv_bytes_per_token,
        "kv_cache_bytes_per_token_after": after.kv_bytes_per_token,
        "identity": before.kv_heads == after.kv_heads,
    }
    ctx.log(
        f"gqa: KV heads {before.kv_heads} -> {after.kv_heads}; KV cache "
        f"{before.kv_bytes_per_token} -> {after.kv_bytes_per_token} bytes/token"
    )
    if cfg.heal is not None:
        facts["heal"] = finetune(model, cfg.heal, ctx.train_ids, teacher=teacher, seed=ctx.seed, who="heal", log=ctx.log,
                                 progress=ctx.progress)
    del teacher
    ctx.details.update(facts)
    return model
