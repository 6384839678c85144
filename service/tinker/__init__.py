"""The Tinker training protocol served beside the job API: its wire format, sessions, training models
and futures (no HTTP framework here)."""
