"""Whether a model can take a parallel layout, decided before anything is built.

The sizes of ``train.parallel`` must multiply to the world size, and the model must split the way
each dimension splits it: attention heads, KV heads and MLP columns over ``tp``; decoder blocks
over ``pp``; experts over ``ep``. Each refusal names the number that does not divide and why it
must. The same checks run in ``python -m train --check`` (from the config, on a weightless model)
and at the start of a run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from train.parallel.config import ParallelConfig
from train.errors import TrainInputError

#: families whose decoder block has separate q/k/v/o and gate/up/down Linears the tensor plan splits
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
#: families whose base model is embed -> rotary -> blocks (causal or sliding-window masks) -> norm ->
#: head (the pipeline stages rebuild that forward); for MoE families the loss is the LM loss, as in
#: the single-process loop (no router auxiliary loss)
PP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: why the families left out of each list cannot take the split
WHY_NOT = {
    "phi3": "its attention and MLP use fused qkv_proj and gate_up_proj, which a column split would cut across q, "
    "k and v",
    "gpt2": "its projections are transformers Conv1D, not nn.Linear",
    "gemma2": "its blocks alternate sliding-window and global masks and its head soft-caps the logits, which "
    "the pipeline stages do not rebuild",
    "gemma3_text": "its blocks alternate sliding-window and global masks and their rotary tables, which the "
    "pipeline stages do not rebuild",
}


@dataclass(frozen=True)
class Layout:
    """Resolved sizes of every mesh dimension (``dp_shard`` no longer 'auto')."""

    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_shard * self.tp * self.pp

    def describe(self) -> str:
        return " x ".join(f"{k} {v}" for k, v in asdict(self).items()) + f" = {self.world} ranks"


def resolve(par: ParallelConfig, world: int, fsdp: bool = True) -> Layout:
    """The layout for ``world`` ranks; refuses sizes that do not multiply to it, and data-parallel
    ranks without ``distributed.fsdp`` (they are sharded by FSDP2)."""
    fixed = par.tp * par.pp
    if par.dp_shard == "auto":
        if world % fixed:
            raise TrainInputError(
                f"train.parallel: tp {par.tp} x pp {par.pp} = {fixed} does not divide the world size {world}"
            )
        dp = world // fixed
    else:
        dp = par.dp_shard
    layout = Layout(dp_shard=dp, tp=par.tp, pp=par.pp, ep=par.ep)
    if layout.world != world:
        raise TrainInputError(
            f"train.parallel: dp_shard {dp} x tp {par.tp} x pp {par.pp} = {layout.world}, but the world size is "
            f"{world} (torchrun --nproc_per_node); the sizes must multiply to it"
        )
    if dp % par.ep:
        raise TrainInputError(f"train.parallel: ep {par.ep} takes its ranks from dp_shard {dp}, so it must divide it")
    if dp > 1 and not fsdp:
        raise TrainInputError(
            f"train.parallel: dp_shard {dp} shards the data-parallel ranks with FSDP2: set distributed.fsdp: true"
        )
    return layout


def _family(config) -> str:
    return getattr(config, "model_type", type(config).__name__)


def _refuse_family(dim: str, family: str, allowed: tuple[str, ...]) -> None:
    if family not in allowed:
        why = WHY_NOT.get(family, "its blocks are not laid out the way the split expects")
        raise TrainInputError(
            f"train.parallel.{dim}: model_type '{family}' cannot take it: {why}; supported: {', '.join(allowed)}"
        )


def num_experts(config) -> int:
    """Routed experts per MoE block (0 for a dense model)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def check_model(layout: Layout, config, seq_lens: list[int], par: ParallelConfig) -> None:
    """Refuse a model (its HF config) that ``layout`` cannot split; ``seq_lens`` are every window
    length the run trains on (the curriculum's and the full one)."""
    family = _family(config)
    if layout.tp > 1:
        if num_experts(config):
            raise TrainInputError(
                f"train.parallel.tp: '{family}' is a mixture-of-experts model; split its experts with ep, not tp"
            )
        _refuse_family("tp", family, TP_FAMILIES)
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                            ("intermediate_size", config.intermediate_size)):
            if value % layout.tp:
                raise TrainInputError(
                    f"train.parallel.tp {layout.tp} must divide the model's {name} {value}: each rank takes "
                    f"1/{layout.tp} of them"
                )
        if par.sequence_parallel:
            for n in seq_lens:
                if n % layout.tp:
                    raise TrainInputError(
                        f"train.parallel.sequence_parallel: window length {n} is not divisible by tp {layout.tp}; "
                        "the norms shard the sequence evenly (change data.seq_len / the curriculum, or turn "
                        "sequence_parallel off)"
                    )
    if layout.pp > 1:
        _refuse_family("pp", family, PP_FAMILIES)
        layers = config.num_hidden_layers
        if layers < layout.pp:
            raise TrainInputError(
                f"train.parallel.pp {layout.pp}: the model has {layers} decoder blocks, fewer than the stages"
            )
        if getattr(config, "tie_word_embeddings", False):
            raise TrainInputError(
                f"train.parallel.pp {layout.pp}: the model ties its output head to its input embedding, which "
                "the pipeline puts on the first and the last stage; untie them (tie_word_embeddings: false) first"
            )
    if layout.ep > 1:
        experts = num_experts(config)
        if not experts:
            raise TrainInputError(
                f"train.parallel.ep {layout.ep}: model_type '{family}' has no routed experts (not a "
                "mixture-of-experts model)"
            )
        if experts % layout.ep:
            raise TrainInputError(
                f"train.parallel.ep {layout.ep} must divide the model's {experts} experts per block"
            )


def check_modules(layout: Layout, model: nn.Module) -> None:
    """What only the built model shows: the expert modules expert parallelism shards."""
    if layout.ep > 1:
        from targets.moe import ExpertsRefused, check_layout, is_fused_experts

        fused = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
        for name, m in fused:  # the expert split computes the experts from Mixtral's layout only
            try:
                check_layout(name, m)
            except ExpertsRefused as exc:
                raise TrainInputError(f"train.parallel.ep {layout.ep}: {exc}") from None
        if not fused:
            raise TrainInputError(
                f"train.parallel.ep {layout.ep}: {type(model).__name__} has no experts module with stacked "
                "gate_up_proj/down_proj weights (transformers' fused MoE layout), which the expert split shards"
            )
