"""mixprec inside the training frameworks people already use (docs/integrations.md): a Lightning
precision plugin (`.lightning`, `.pytorch_lightning`), accelerate helpers (`.accelerate`) and the
Hugging Face Trainer (`.transformers`); each submodule imports its framework, `import mixprec` none."""
