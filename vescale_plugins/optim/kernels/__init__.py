"""Fused optimizer kernels: a vectorised torch reference (CPU, CI) and Triton kernels (CUDA).

* :mod:`.quant_map`: the dynamic 8-bit quantisation maps (bitsandbytes / torchao).
* :mod:`.adam8bit_torch`: dequantise -> AdamW -> requantise on tiles, in torch.
* :mod:`.adam8bit_triton`: the same, one Triton program per tile, one launch per buffer.
"""
