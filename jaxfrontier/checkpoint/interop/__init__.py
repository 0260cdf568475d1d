"""Formats other programs read and write: safetensors and Hugging Face directories (docs/inference.md).

  safetensors   the writer, a checkpoint's parameters exported, a file's parameters loaded
  hf_files      a Hugging Face directory's files checked before reading (config.json, headers, shapes)
  hf            export and import one layer at a time, through the family's converter
  init_from     `checkpoint.init_params_from`: a safetensors file, a Hugging Face directory or a checkpoint
"""
