"""Worker package: training/inference side of the RLOO service."""
