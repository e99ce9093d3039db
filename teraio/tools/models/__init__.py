"""Built-in workloads: models written in the project, with synthetic data, no downloads."""

from teraio.tools.models.gpt import CONFIGS, GPT, GPTConfig, build_gpt, synthetic_batch

__all__ = ["CONFIGS", "GPT", "GPTConfig", "build_gpt", "synthetic_batch"]
