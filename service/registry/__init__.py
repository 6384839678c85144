"""What a model id names: the models root (``model_root``), fine-tuned model ids (``finetuned``),
resolving any id the API takes to weights that can serve (``weights``), and exports."""
