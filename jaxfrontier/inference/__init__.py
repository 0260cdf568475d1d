"""Inference on a trained or imported model: sampling (`--mode=sample`), evaluation (`--mode=eval`),
log-likelihood scoring and the lm-evaluation-harness adapter (`--mode=lm_eval`).

  load      any checkpoint, safetensors file or Hugging Face directory onto a non-pipelined mesh
            (through checkpoint/; nothing of training/)
  generate  prefill and the KV-cached decode loop, sampling rules; stops: where a row ends
  sample    --mode=sample;  evaluate: --mode=eval (loss, perplexity, bits per byte)
  scoring   log-likelihood of (context, continuation) requests;  harness: lm-eval's TemplateLM
  text      the run's tokenizer, or bytes

Hugging Face import and export are checkpoint/interop/'s.
"""
