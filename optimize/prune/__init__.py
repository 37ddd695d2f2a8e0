"""Pruning: importance scores on calibration text, structured surgery (blocks, GQA-aware heads,
MLP channels) that yields a smaller dense transformers model, and unstructured / 2:4 sparsity.
The ``prune`` stage (:mod:`optimize.stages.prune`) drives it."""
