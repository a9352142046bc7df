"""Dequant-matmul and attention kernels. Imports nothing of flotilla's."""
from .gptq import GPTQWeight, pack_cols, pack_rows, unpack_cols, unpack_rows
from .reference import dequantize, gptq_matmul

__all__ = ["GPTQWeight", "dequantize", "gptq_matmul", "pack_rows", "unpack_rows", "pack_cols", "unpack_cols"]
