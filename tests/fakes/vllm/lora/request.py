"""vLLM's ``LoRARequest`` (name, a positive int id, the adapter's directory), as the stand-in takes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
