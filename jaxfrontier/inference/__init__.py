"""Inference: sampling (`--mode=sample`), evaluation (`--mode=eval`) and Hugging Face interop."""
