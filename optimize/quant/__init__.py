"""Quantization algorithms behind the stages: fake-quant numerics, exact equalization folds
(SmoothQuant, AWQ), HQQ scale choice via torchao, and mixed precision under a size budget."""
