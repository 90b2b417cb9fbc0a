"""qwen4exp: serve Qwen3.8-Flash-Next (Hugging Face `qwen4_exp`) on one box."""

__version__ = "0.1.0"
