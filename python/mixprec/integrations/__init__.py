"""mixprec inside the training frameworks people already use (docs/integrations.md): a Lightning
precision plugin (`.lightning`, `.pytorch_lightning`), the Hugging Face Trainer (`.transformers`);
each submodule imports its framework, so `import mixprec` never needs them."""
