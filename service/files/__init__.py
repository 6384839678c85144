"""Uploaded files: the datasets' formats and checks (``datasets``) and the sweep that removes
uploads left half-written (``upload_sweep``)."""
