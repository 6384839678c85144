"""Tinker's training primitives on a model held in memory: pure torch, no broker, database or HTTP."""
