"""Virtual Parameter Space: state keys, boxes, fragments, layouts and the transition planner.

Pure metadata: nothing here opens a process group. See ``layouts/`` for the layout families.
"""
from .layout import BufferSpec, Fragment, Layout, LayoutError, Region, select, union
from .layouts import ParallelConfig, build_layout, fsdp, replicated, zero
from .layouts.vllm import vllm_layout
from .planner import Plan, RankPlan, Transfer, minimum_bytes_received, plan_rank, plan_transition
from .space import ADAM_FIELDS, EXP_AVG, EXP_AVG_SQ, MASTER, PARAM, Box, StateKey, flat_range_to_boxes
from .spec import ModelSpec, TensorSpec, llama_spec, synthetic_spec

__all__ = [
    "ADAM_FIELDS", "Box", "BufferSpec", "EXP_AVG", "EXP_AVG_SQ", "Fragment", "Layout", "LayoutError",
    "MASTER", "ModelSpec", "PARAM", "ParallelConfig", "Plan", "RankPlan", "Region", "StateKey",
    "TensorSpec", "Transfer", "build_layout", "flat_range_to_boxes", "fsdp", "llama_spec",
    "minimum_bytes_received", "plan_rank", "plan_transition", "replicated", "select", "synthetic_spec", "union",
    "vllm_layout", "zero",
]
