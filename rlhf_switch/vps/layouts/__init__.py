"""Layout families — one small module each — and their DP×TP×PP composition."""
from .mesh import ParallelConfig, build_layout, fsdp, replicated, zero

__all__ = ["ParallelConfig", "build_layout", "fsdp", "replicated", "zero"]
