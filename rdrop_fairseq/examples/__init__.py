"""Examples of the plugin's torch-only core, runnable with ``python -m``; none imports fairseq."""
