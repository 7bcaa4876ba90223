"""torchtitan's Llama 3 on tpu: its tensor-parallel plan, FSDP and activation checkpointing."""

from .parallelize import parallelize_llama, tp_plan  # noqa: F401
