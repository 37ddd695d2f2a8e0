"""Pure weight-algebra rewrites used by the ``rmsnorm`` and ``gqa`` stages.

Kept apart from the stages so they can be tested, and reused, without a pipeline:
``layernorm_fold`` (exact LayerNorm -> RMSNorm for pre-LN models, with per-architecture
plans in ``ln_plans``) and ``gqa`` (KV-head pooling for Llama-family attention).
"""
