"""Model families, their layers and weight loaders, the registry and the tokenizer."""
